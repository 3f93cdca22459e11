"""Lightning's autoencoder example (examples/pytorch/basics/autoencoder.py) on synthetic images, ported by
docs/lightning.md's rename table alone.

    python examples/lightning/autoencoder.py --trainer.max_epochs 2

The images are 8 x 8 in place of MNIST's 28 x 28 and lie near a 3-dimensional family (the code size of the
bottleneck), so a few epochs of a small network reconstruct them well. As in Lightning's example the script fits,
tests the best checkpoint and predicts with it; the callback reports how well validation images are reconstructed
at the end of every epoch (Lightning's saves image grids with torchvision).

Adapted from PyTorch Lightning's example (Copyright The Lightning AI team, Apache License 2.0).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from trainkit import DataModule, Trainer, TrainModule, callbacks
from trainkit.cli import TrainkitCLI
from trainkit.utilities import rank_zero_only

SIDE = 8


def synthetic_digits(n: int, seed: int) -> TensorDataset:
    """``n`` images in [0, 1] made from 3 random factors by one fixed map, with a label from the first factor."""
    basis = torch.randn(3, SIDE * SIDE, generator=torch.Generator().manual_seed(0))
    factors = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
    images = torch.sigmoid(factors @ basis).view(n, 1, SIDE, SIDE)
    return TensorDataset(images, (factors[:, 0] > 0).long())


class ImageSampler(callbacks.Callback):
    def __init__(self, num_samples: int = 3) -> None:
        super().__init__()
        self.num_samples = num_samples

    @rank_zero_only
    def on_train_epoch_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        images, _ = next(iter(DataLoader(trainer.datamodule.mnist_val, batch_size=self.num_samples)))
        images_flattened = images.view(images.size(0), -1)

        with torch.no_grad():
            pl_module.eval()
            images_generated = pl_module(images_flattened.to(pl_module.device))
            pl_module.train()

        error = F.mse_loss(images_generated.cpu(), images_flattened).item()
        print(f"epoch {trainer.current_epoch}: {self.num_samples} validation images reconstructed, mse {error:.5f}")


class LitAutoEncoder(TrainModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(SIDE * SIDE, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, SIDE * SIDE))

    def forward(self, x):
        z = self.encoder(x)
        return self.decoder(z)

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(DataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        dataset = synthetic_digits(480, seed=1)
        self.mnist_test = synthetic_digits(80, seed=2)
        self.mnist_train, self.mnist_val = random_split(dataset, [400, 80], generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def cli_main():
    cli = TrainkitCLI(
        LitAutoEncoder,
        MyDataModule,
        seed_everything_default=1234,
        run=False,
        trainer_defaults={"callbacks": ImageSampler(), "max_epochs": 10},
        save_config_kwargs={"overwrite": True},
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    print(predictions[0])


if __name__ == "__main__":
    cli_main()
