"""Lightning's GAN example (examples/pytorch/domain_templates/generative_adversarial_net.py) on synthetic images,
ported by docs/lightning.md's rename table alone: two optimizers, manual optimization, ``toggle_optimizer``.

    python examples/lightning/gan.py --max_epochs 2
    python examples/lightning/gan.py --max_epochs 2 --devices 2 --strategy ddp

The images are 1 x 8 x 8 in place of MNIST's 1 x 28 x 28 and the layers are a quarter as wide or less (same
depth, the same BatchNorm and in-place LeakyReLU), so an epoch takes a moment on a CPU. At the end of every epoch
the generator's samples go to each logger as one image strip (``generated_images``), as Lightning's example does
with torchvision's grid.

Adapted from PyTorch Lightning's example (Copyright The Lightning AI team, Apache License 2.0).
"""

from argparse import ArgumentParser, Namespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainkit import DataModule, Trainer, TrainModule, seed_everything


class SynthMNISTDataModule(DataModule):
    """Images in [-1, 1] drawn near a 4-dimensional family, with a label each; the loader owns its generator, so
    starting it draws nothing from the global random state the generator's noise comes from."""

    def __init__(self, batch_size: int = 32, num_samples: int = 256, img_shape: tuple = (1, 8, 8)):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(7)
        basis = torch.randn(4, int(np.prod(img_shape)), generator=g)
        images = torch.tanh(torch.randn(num_samples, 4, generator=g) @ basis).view(num_samples, *img_shape)
        self.dataset_train = TensorDataset(images, torch.randint(0, 10, (num_samples,), generator=g))

    def train_dataloader(self):
        return DataLoader(self.dataset_train, batch_size=self.batch_size, drop_last=True,
                          generator=torch.Generator().manual_seed(0))


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 16, img_shape: tuple = (1, 8, 8)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 32, normalize=False),
            *block(32, 64),
            *block(64, 128),
            *block(128, 256),
            nn.Linear(256, int(np.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape):
        super().__init__()

        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), 128),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(128, 64),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(64, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(TrainModule):
    def __init__(
        self,
        img_shape: tuple = (1, 8, 8),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 16,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch

        opt_g, opt_d = self.optimizers()

        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # the generator: how well do its images pass for real ones?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # the discriminator: real images as real, generated ones (detached from the generator) as fake
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d

    def on_train_epoch_end(self):
        z = self.validation_z.type_as(self.generator.model[0].weight)

        sample_imgs = self(z)
        grid = (torch.cat(list(sample_imgs), dim=-1) + 1) / 2
        for logger in self.loggers:
            logger.experiment.add_image("generated_images", grid, self.current_epoch)


def main(args: Namespace) -> None:
    seed_everything(args.seed)
    model = GAN(lr=args.lr, b1=args.b1, b2=args.b2, latent_dim=args.latent_dim)

    dm = SynthMNISTDataModule()
    trainer = Trainer(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
                      max_epochs=args.max_epochs, log_every_n_steps=args.log_every_n_steps,
                      use_distributed_sampler=args.use_distributed_sampler == "true")

    trainer.fit(model, dm)


if __name__ == "__main__":
    parser = ArgumentParser()

    parser.add_argument("--lr", type=float, default=0.0002, help="adam: learning rate")
    parser.add_argument("--b1", type=float, default=0.5, help="adam: decay of first order momentum of gradient")
    parser.add_argument("--b2", type=float, default=0.999, help="adam: decay of second order momentum of gradient")
    parser.add_argument("--latent_dim", type=int, default=16, help="dimensionality of the latent space")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and of the generator's noise")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu, cuda or auto")
    parser.add_argument("--devices", type=int, default=1, help="processes (one per device)")
    parser.add_argument("--strategy", default="auto", help="how several devices share the work: ddp, say")
    parser.add_argument("--max_epochs", type=int, default=5, help="epochs to train")
    parser.add_argument("--log_every_n_steps", type=int, default=1, help="how often the losses are logged")
    parser.add_argument("--use_distributed_sampler", choices=("true", "false"), default="true",
                        help="false: every process reads all the data (a run on several is then one process's)")
    args = parser.parse_args()

    main(args)
