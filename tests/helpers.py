"""Small modules and data shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics import MeanSquaredError

import trainkit as tk
from trainkit.callbacks import Callback

# Where a one-process Trainer with accelerator="auto" trains: references are built and compared there.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def accelerator_for(world_size: int) -> str:
    """The accelerator for a run of ``world_size`` ranks on this machine: "auto" (CUDA where there is a GPU)
    when every rank can have a GPU of its own or there is no GPU at all, "cpu" (gloo) otherwise."""
    gpus = torch.cuda.device_count()
    return "auto" if gpus == 0 or gpus >= world_size else "cpu"


def regression_data(n: int = 64, dim: int = 8, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    w = torch.randn(dim, 1, generator=gen)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=gen))


def mlp(dim: int = 8, hidden: int = 16, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1))


def adamw_groups(model: nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    """Two param groups with different weight decay (biases undecayed), as users write them."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)


class Regression(tk.TrainModule):
    """MSE regression on an MLP; optional dropout (exercises RNG) and a step LR scheduler."""

    def __init__(self, dim: int = 8, hidden: int = 16, dropout: float = 0.0, lr: float = 1e-2,
                 scheduler: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp(dim, hidden, dropout, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y.float())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y.float()))

    # pipeline strategy: the same model as layers, the same loss on the last layer's output
    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(output.float(), batch[1].float())

    def pipeline_validation_step(self, output: torch.Tensor, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"val_loss": F.mse_loss(output.float(), batch[1].float())}

    def configure_optimizers(self) -> Any:
        opt = adamw_groups(self, self.hparams.lr)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ValidatedRegression(Regression):
    """Validation logged with sync_dist (a batch-weighted mean) and through a torchmetrics metric."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = MeanSquaredError()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        pred = self(x)
        self.log("val_loss", F.mse_loss(pred, y), sync_dist=True)
        self.log("val_max", (pred - y).abs().max(), sync_dist=True, reduce_fx="max")
        self.mse(pred, y)
        self.log("val_mse", self.mse)


class LossValidatedRegression(Regression):
    """Without ``pipeline_validation_step``: under pipeline, validation reports ``pipeline_loss`` as val_loss."""

    pipeline_validation_step = None


class BatchNormRegression(ValidatedRegression):
    """An MLP with BatchNorm: per-rank batch statistics in training, running statistics in validation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # no bias before the norm: its gradient is exactly zero, and Adam would turn rounding noise into steps
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


class LeakyGenerator(ValidatedRegression):
    """Lightning's GAN generator (generative_adversarial_net.py): blocks of Linear, BatchNorm1d (its eps of 0.8) and
    LeakyReLU(0.2, inplace=True), flattened into one Sequential, so every activation modifies a unit's output in
    place under zero3 and fsdp."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16, 0.8), nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16, 0.8), nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(16, 1))


class RMSNorm(nn.Module):
    """A norm with no reset_parameters: its weight comes from ``torch.ones`` in the constructor."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MixingBlock(nn.Module):
    """Buffers computed by chains of ops (a causal mask, a cosine table) and a parameter from torch.randn."""

    def __init__(self, dim: int, length: int) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = RMSNorm(dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(length, length)) / torch.arange(1, length + 1)[:, None])
        table = torch.cos(torch.outer(torch.arange(length).float(), torch.linspace(0.1, 1.0, dim)))
        self.register_buffer("table", table, persistent=False)
        self.gate = nn.Parameter(torch.randn(dim) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.mask[:t, :t] @ (self.fc(self.norm(x)) + self.table[:t])
        return x + self.proj(torch.tanh(h)) * self.gate


class DeferredInitNet(tk.TrainModule):
    """Built in configure_model with the initialisation users write (nanoGPT's ``apply(_init_weights)``
    with ``.data.normal_``, ``trunc_normal_``, a seeded generator, in-place fills): under zero3/fsdp it is
    built on the meta device, and must still start from the values a one-process run gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.inp = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(MixingBlock(16, 8) for _ in range(3))
        self.out = nn.Linear(16, 1)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.trunc_normal_(p, std=0.05)
        with torch.no_grad():
            self.out.weight.data.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(7))
            self.out.bias.fill_(0.25)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.2)
            if module.bias is not None:
                module.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).mean(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw_groups(self)


def sequence_regression_data(n: int, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, 4, generator=gen)
    return TensorDataset(x, torch.tanh(x.sum((1, 2)))[:, None])


class Routed(nn.Module):
    """Samples with x[0] > 1 go through ``rare``, the others through ``common``; ``never`` is never used.
    With 4 samples per rank, ``rare`` is often unused on one rank and used on another."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.common, self.rare, self.never = nn.Linear(8, 1), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
        route = x[:, 0] > 1.0
        if route.any():
            out[route] = self.rare(x[route])
        if (~route).any():
            out[~route] = self.common(x[~route])
        return out


class RoutedRegression(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.net = Routed()


class RoutedItemsRegression(RoutedRegression):
    """Routed, with the samples returned as ``num_items``: the step then sums the count over ranks between
    backward and the gradients' reduction, which a bucket left to the end of the step on one rank only would
    cross. ``never`` is registered first, so the buckets backward fills first are ``rare``'s and ``common``'s:
    one rank completes them during backward where another does not."""

    def __init__(self) -> None:
        super().__init__()
        routed = self.net
        self.net = Routed.__new__(Routed)
        nn.Module.__init__(self.net)
        self.net.never, self.net.common, self.net.rare = routed.never, routed.common, routed.rare

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"loss": super().training_step(batch, batch_idx), "num_items": batch[0].shape[0]}


class MaskedSequences(Dataset):
    """Sequences with a variable number of valid positions (the rest padding): ``num_items`` varies."""

    def __init__(self, n: int = 48, length: int = 6, dim: int = 8, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, length, dim, generator=gen)
        self.y = torch.randn(n, length, 1, generator=gen)
        lengths = torch.randint(0, length + 1, (n,), generator=gen)
        self.mask = torch.arange(length)[None, :] < lengths[:, None]

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], self.mask[i]


def masked_loss(net: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean squared error over the valid positions, and their count."""
    return masked_loss_of(net(batch[0]), batch)


def masked_loss_of(output: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    _, y, mask = batch
    err = (output - y).pow(2).squeeze(-1)
    n = mask.sum()
    return (err * mask).sum() / n.clamp(min=1), n


class MaskedRegression(tk.TrainModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.net = mlp()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss, n = masked_loss(self.net, batch)
        return {"loss": loss, "num_items": n}

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> dict[str, Any]:
        loss, n = masked_loss_of(output, batch)
        return {"loss": loss, "num_items": n}

    def configure_optimizers(self) -> Any:
        return adamw_groups(self.net, self.lr)


class Recorder(Callback):
    """Records each micro-batch's loss (as returned) and the step it belonged to."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append((trainer.global_step, loss.item()))


def quiet_trainer(tmp_path: Any, **kwargs: Any) -> tk.Trainer:
    """A Trainer with no logger, progress bar or checkpointing unless asked for."""
    defaults: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_checkpointing=False,
                                    num_sanity_val_steps=0, default_root_dir=tmp_path, max_epochs=1)
    return tk.Trainer(**(defaults | kwargs))


def loader(dataset: Dataset, batch_size: int, shuffle: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def step_as_rank_1(strategy: Any, model: nn.Module, world: int, precision: str = "bf16-mixed") -> Any:
    """``strategy`` set up on ``model`` (AdamW groups) as rank 1 of ``world`` (under a fake process group), after one
    step on a random batch of 4 and ``zero_grad``: what a rank holds between steps."""
    from trainkit_strategies import Environment, Precision

    strategy.setup_environment(Environment(rank=1, world_size=world))
    strategy.setup(model, adamw_groups(model), Precision.from_name(precision))
    with strategy.forward_context():
        loss = model(torch.randn(4, model[0].in_features)).float().square().mean()
    strategy.backward(loss)
    del loss
    strategy.reduce_gradients(1.0 / world)
    strategy.optimizer_step()
    strategy.zero_grad()
    return strategy

