"""A GAN in the shape of Lightning's ``generative_adversarial_net.py`` (two optimizers, manual optimization,
``toggle_optimizer``), small enough for CPU parity runs, and the same algorithm as a hand-written PyTorch loop.

The noise of each sample comes with the data, so a rank's share of a global batch draws what one process drawing
the whole batch would; the models have no BatchNorm (per-rank statistics differ from one process's by design)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import trainkit as tk

DIM, LATENT = 6, 3


def gan_data(n: int = 64, seed: int = 1) -> TensorDataset:
    """Real samples (a squashed Gaussian) with the generator's noise for each."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, DIM, generator=g).tanh(), torch.randn(n, LATENT, generator=g))


def _generator() -> nn.Module:
    return nn.Sequential(nn.Linear(LATENT, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.LeakyReLU(0.2),
                         nn.Linear(16, DIM), nn.Tanh())


def _discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def _adversarial(logits: Tensor, real: bool) -> Tensor:
    target = torch.ones_like(logits) if real else torch.zeros_like(logits)
    return F.binary_cross_entropy_with_logits(logits, target)


class GAN(tk.TrainModule):
    """Generator and discriminator, each with its own Adam; ``losses`` holds every batch's global (g, d) losses."""

    def __init__(self, lr: float = 2e-3, clip: float | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator, self.discriminator = _generator(), _discriminator()
        self.losses: list[Tensor] = []

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        g_loss = _adversarial(self.discriminator(self(z)), real=True)
        self.manual_backward(g_loss)
        if self.hparams.clip is not None:
            self.clip_gradients(opt_g, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = _adversarial(self.discriminator(real), real=True)
        fake_loss = _adversarial(self.discriminator(self(z).detach()), real=False)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        pair = torch.stack([g_loss.detach(), d_loss.detach()])
        self.losses.append(self.all_gather(pair).reshape(-1, 2).mean(0))  # every rank's mean: the global batch's

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        return (torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999)))


def train_plain(batches: int, batch_size: int, clip: float | None = None, lr: float = 2e-3) -> list[Tensor]:
    """The same algorithm by hand, on whole global batches in order: (g, d) losses per batch."""
    module = GAN(lr=lr)
    gen, disc = module.generator, module.discriminator
    opt_g = torch.optim.Adam(gen.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.999))
    data, losses = gan_data(), []
    steps = len(data) // batch_size
    for i in range(batches):
        real, z = data[(i % steps) * batch_size : (i % steps + 1) * batch_size]
        disc.requires_grad_(False)
        g_loss = _adversarial(disc(gen(z)), real=True)
        g_loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(gen.parameters(), clip)
        opt_g.step()
        opt_g.zero_grad()
        disc.requires_grad_(True)
        gen.requires_grad_(False)
        d_loss = (_adversarial(disc(real), real=True) + _adversarial(disc(gen(z).detach()), real=False)) / 2
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        gen.requires_grad_(True)
        losses.append(torch.stack([g_loss.detach(), d_loss.detach()]))
    return losses


class Dropped(tk.TrainModule):
    """A backward whose gradients ``zero_grad()`` drops before the step: the first loss reaches both heads, the
    second only ``b``, so ``a`` must not move (SGD, no momentum) and ``b`` steps on the second loss alone."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(DIM, 1), nn.Linear(DIM, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        real, _ = batch
        self.manual_backward((self.a(real) + self.b(real)).square().mean())
        opt.zero_grad()
        self.manual_backward(self.b(real).square().mean())
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def dropped_plain(batches: int, batch_size: int) -> dict[str, Tensor]:
    module = Dropped()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    data = gan_data()
    for i in range(batches):
        real = data[i * batch_size : (i + 1) * batch_size][0]
        module.b(real).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters()}
