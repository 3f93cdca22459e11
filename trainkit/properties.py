"""What a Lightning user reads off the Trainer: progress, ranks, metrics, loggers, loaders, step budgets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainkit.callbacks.checkpointing import ModelCheckpoint
from trainkit.data import DataConnector, num_batches
from trainkit.loggers import Logger

if TYPE_CHECKING:
    from trainkit.callbacks.base import Callback
    from trainkit.evaluation import EvalLoop
    from trainkit.loops import FitLoop, Progress
    from trainkit.module import TrainModule
    from trainkit.optim import OptimizerConfig, SchedulerConfig
    from trainkit.results import Results
    from trainkit_strategies import DynamicLossScaler, Environment, Precision, Strategy


class TrainerProperties:
    """Read-only views of a Trainer's state (and ``should_stop``, which callbacks set)."""

    strategy: Strategy
    module: TrainModule | None
    precision: Precision
    env: Environment
    progress: Progress
    results: Results
    data: DataConnector
    fit_loop: FitLoop | None
    evaluation: EvalLoop | None
    loggers: list[Logger]
    callbacks: list[Callback]
    optimizer_config: OptimizerConfig | None
    default_root_dir: Path
    state: str
    limit_train_batches: int | float | None
    accumulate_grad_batches: int
    max_epochs: int | None
    max_steps: int
    _logged_metrics: dict[str, float]

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def current_epoch(self) -> int:
        return self.progress.epoch

    @property
    def should_stop(self) -> bool:
        """Set it (from a callback, say) to end training at the next batch; every rank must set it alike."""
        return self.progress.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.progress.should_stop = value

    @property
    def sanity_checking(self) -> bool:
        """True while the sanity validation before training runs."""
        return self.evaluation is not None and self.evaluation.sanity_checking

    @property
    def accumulating(self) -> bool:
        """True between the micro-batches of one optimizer step (an accumulation window is open)."""
        return self.fit_loop is not None and self.fit_loop.step.window > 0

    @property
    def lightning_module(self) -> TrainModule | None:
        """The module of the current run, or of the last one (Lightning's name; what ``test()`` with no model runs)."""
        return self.module

    @property
    def global_rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.strategy.optimizer

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The loss scaler the precision policy owns ("16-mixed"; None under every other policy)."""
        return self.precision.scaler

    @property
    def train_dataloader(self) -> Any:
        return self.data.train_dataloader

    @property
    def val_dataloaders(self) -> list[Any]:
        """The validation (or, under ``test``/``predict``, the test/predict) loaders of the run."""
        return self.data.val_dataloaders

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """Latest logged values on this rank (epoch aggregates after each epoch/validation), as 0-d
        float64 tensors like Lightning's (float64: exactly the logged values)."""
        values = self.results.local_values(prog_bar_only=False)
        return {k: torch.tensor(v, dtype=torch.float64, device="cpu") for k, v in values.items()}

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        values = self.results.local_values(prog_bar_only=True)
        loss = self.fit_loop.step.last_loss if self.fit_loop is not None else None
        return {"loss": float(loss), **values} if loss is not None else values

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps this ``fit`` will take: ``max_steps``, or the epochs times the batches per
        epoch (after ``limit_train_batches``) divided by the accumulation, whichever is smaller; ``inf``
        when the loader has no length and ``max_steps`` is unset. Usable in ``configure_optimizers``
        (to size a OneCycleLR, say): it fetches the training data early when needed."""
        if self.state != "fit":
            raise RuntimeError("estimated_stepping_batches is known only during fit.")
        return self.estimated_steps(num_batches(self.data.train(), self.limit_train_batches))

    @property
    def num_training_batches(self) -> float:
        """Batches of one training epoch on this rank, after ``limit_train_batches`` (``inf`` if unknown)."""
        if self.data.train_dataloader is None:
            return 0
        return num_batches(self.data.train_dataloader, self.limit_train_batches)

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every metric sent to the loggers, as 0-d tensors."""
        return {k: torch.tensor(v, dtype=torch.float64, device="cpu") for k, v in self._logged_metrics.items()}

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def log_dir(self) -> Path | None:
        """The first logger's run directory (``runs/<name>/version_N``), or None without a logger."""
        return self.logger.log_dir if self.logger is not None else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers from ``configure_optimizers``, in the order returned."""
        return list(self.optimizer_config.optimizers) if self.optimizer_config is not None else []

    @property
    def lr_scheduler(self) -> Any:
        """The (first) LR scheduler from ``configure_optimizers``, or None."""
        return self.optimizer_config.scheduler if self.optimizer_config is not None else None

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        """Every LR scheduler with its interval, frequency and monitor."""
        return list(self.optimizer_config.schedulers) if self.optimizer_config is not None else []

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    @property
    def checkpoint_dir(self) -> Path:
        for cb in self.callbacks:
            if isinstance(cb, ModelCheckpoint):
                return cb.resolve_dirpath(self)
        return self.default_root_dir / "checkpoints"

    def estimated_steps(self, batches_per_epoch: float) -> float:
        per_epoch = math.ceil(batches_per_epoch / self.accumulate_grad_batches)
        by_epochs = per_epoch * self.max_epochs if self.max_epochs is not None else math.inf
        return min(by_epochs, self.max_steps if self.max_steps >= 0 else math.inf)

