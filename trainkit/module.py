"""TrainModule: the user's model, its steps, its optimizer and (optionally) its data."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from trainkit.hooks import ModelHooks
from trainkit.manual import ManualOptimizer, ManualStep

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from trainkit.loggers import Logger
    from trainkit.trainer import Trainer

M = TypeVar("M", bound="TrainModule")


class AttributeDict(dict):
    """A dict whose keys read as attributes: ``self.hparams.lr``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"No hyperparameter {key!r}; saved: {sorted(self)}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class TrainModule(ModelHooks, nn.Module):
    """Subclass this, then hand it to ``Trainer.fit`` or the ``trainkit`` command line.

    Implement ``training_step`` and ``configure_optimizers``; everything else is optional. A step
    returns the loss, or ``{"loss": loss, "num_items": n}`` where ``loss`` is the mean over ``n``
    items (tokens, say): the trainer then weights each micro-batch by its count so accumulated and
    distributed steps equal one step on the whole batch.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self._planned = False  # a meta copy the planner traces (``estimate.meta_copy``): reads its Trainer, records
        # nothing in it (no ``self.log``, no gathers) and lives on its own parameters' device
        self._hparams = AttributeDict()
        self._automatic_optimization = True

    # -- steps --------------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | Mapping[str, Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx).")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional. Log metrics with ``self.log``; the validation loop runs only if this is overridden."""

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional. Log metrics with ``self.log``; ``trainer.test`` needs this overridden."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer, ``(optimizer, scheduler)``, or
        ``{"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step" | "epoch", "frequency": 1}}``.
        Build it over ``self.parameters()``; distributed strategies re-target it in place."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers().")

    def configure_model(self) -> None:
        """Create layers here (instead of ``__init__``) to let sharding strategies build them on the meta
        device and materialise only this rank's shards. Must be idempotent: it may be called again."""

    # -- data (optional; a DataModule or dataloaders passed to fit take precedence) ----------------
    def train_dataloader(self) -> DataLoader | None:
        return None

    def val_dataloader(self) -> DataLoader | None:
        return None

    def test_dataloader(self) -> DataLoader | None:
        return None

    def predict_dataloader(self) -> DataLoader | None:
        return None

    # -- logging ------------------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Record a scalar (tensor, number or torchmetrics Metric).

        Defaults follow the stage: training logs per step, validation/test per epoch. ``on_epoch``
        aggregates with ``reduce_fx`` (mean weighted by ``batch_size``, inferred from the batch's first
        tensor when not given; sum, max, min); ``sync_dist`` reduces across ranks when the value is
        emitted, so an epoch mean is the mean over every sample on every rank. Metrics objects compute
        (synchronising across ranks) and reset at epoch end.
        """
        if self._trainer is None or self._planned:
            return
        self._trainer.results.log(name, value, prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
                                  reduce_fx=reduce_fx, sync_dist=sync_dist, batch_size=batch_size)

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.global_rank == 0:
            print(*args, **kwargs)

    # -- hyperparameters ----------------------------------------------------------------------------
    def save_hyperparameters(self, *names: str, ignore: str | list[str] | None = None) -> None:
        """Record the caller's ``__init__`` arguments in ``self.hparams`` (and in checkpoints/loggers)."""
        frame = inspect.currentframe()
        assert frame is not None and frame.f_back is not None
        caller = frame.f_back
        code = caller.f_code  # the __init__ that called us (a subclass may call it through super())
        arg_names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        init_args = {k: caller.f_locals[k] for k in arg_names if k != "self" and k in caller.f_locals}
        if code.co_flags & inspect.CO_VARKEYWORDS:
            extra = caller.f_locals.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount +
                                                         bool(code.co_flags & inspect.CO_VARARGS)])
            if isinstance(extra, dict):
                init_args.update(extra)
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or [])
        if names:
            init_args = {k: init_args[k] for k in names}
        self._hparams.update({k: v for k, v in init_args.items() if k not in ignored})

    @property
    def hparams(self) -> AttributeDict:
        return self._hparams

    @classmethod
    def load_from_checkpoint(cls: type[M], path: str | Path, map_location: str | torch.device | None = None,
                             strict: bool = True, **kwargs: Any) -> M:
        """The module a trainkit checkpoint holds, as Lightning's ``load_from_checkpoint`` builds it: ``cls`` built
        from the checkpoint's saved hyperparameters (``save_hyperparameters``; ``kwargs`` override them), then
        ``configure_model`` and ``on_load_checkpoint``, then every weight read whole, on one process, from a
        checkpoint any strategy wrote at any world size.

        Args:
            path: a checkpoint directory, or a directory holding a ``latest`` pointer (its newest checkpoint).
            map_location: the device to put the module on (default: the CPU, where the checkpoint is read).
            strict: every parameter and persistent buffer in both the module and the checkpoint; ``False`` loads
                those in both and warns about the rest.

        Returns the module in training mode, as Lightning does: call ``.eval()`` before inference."""
        from trainkit.loading import load_from_checkpoint

        return load_from_checkpoint(cls, path, map_location, strict, **kwargs)

    # -- where we are -------------------------------------------------------------------------------
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer.")
        return self._trainer

    @property
    def logger(self) -> Logger | None:
        """The Trainer's first logger (``None`` without a Trainer or a logger), as Lightning's ``self.logger``: its
        ``experiment`` is the logger's own object (TensorBoard's ``SummaryWriter``) for what ``self.log`` does not
        cover, ``self.logger.experiment.add_histogram(...)`` say."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Logger]:
        """Every logger of the Trainer (``[]`` without one)."""
        return self._trainer.loggers if self._trainer is not None else []

    @property
    def device(self) -> torch.device:
        if self._trainer is not None and not self._planned:
            return self._trainer.strategy.device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer else 0

    @property
    def world_size(self) -> int:
        return self._trainer.world_size if self._trainer else 1

    @property
    def local_rank(self) -> int:
        return self._trainer.local_rank if self._trainer else 0

    def all_gather(self, data: Any) -> Any:
        """Gather a tensor, or every tensor in a collection, from all ranks: each gains a leading dimension
        of size ``world_size`` (same shape needed on every rank). On one process the data comes back
        unchanged, as in Lightning. Collective: every rank must call it."""
        if self._trainer is None or self._planned or self._trainer.world_size == 1:
            return data
        return apply_to_collection(data, Tensor, self._trainer.strategy.all_gather)

    # -- optimization -------------------------------------------------------------------------------
    @property
    def automatic_optimization(self) -> bool:
        """True (the default): the trainer runs backward and steps the optimizer. Set it False in ``__init__`` to do
        both in ``training_step`` (``manual_backward``, ``opt.step()``), as Lightning's manual optimization; several
        optimizers need it."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer from ``configure_optimizers``, or a list of them when it returned several. Under manual
        optimization each is wrapped so that ``step()`` and ``zero_grad()`` go through the strategy (reduction,
        loss scaling, the step of this optimizer's own parameters); ``use_pl_optimizer=False`` gives the bare ones."""
        config = self.trainer.optimizer_config
        if config is None or self.trainer.optimizer is None:
            raise RuntimeError("optimizers() is available once fit has set up the optimizer.")
        manual = self._manual()
        found = manual.optimizers if manual is not None and use_pl_optimizer else config.optimizers
        return found[0] if len(found) == 1 else list(found)

    def lr_schedulers(self) -> Any:
        """The LR scheduler from ``configure_optimizers``, a list when it returned several, or None."""
        config = self.trainer.optimizer_config
        schedulers = [s.scheduler for s in config.schedulers] if config is not None else []
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Under manual optimization, back-propagate ``loss`` (this rank's mean loss) through the strategy, with the
        precision policy's loss scale; the gradients are averaged over the ranks when an optimizer steps."""
        self._manual(required="manual_backward").backward(loss, *args, **kwargs)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradients ``optimizer`` steps next ("norm": by their global norm across ranks and shards, the
        default; "value"): applied to the reduced gradients within its ``step()``, before the update."""
        if gradient_clip_val is None:
            return
        manual = self._manual(required="clip_gradients")
        manual.clip(_index_of(manual, optimizer), float(gradient_clip_val), gradient_clip_algorithm or "norm")

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require gradients until ``untoggle_optimizer`` (the others' flags are
        restored then), so a backward for one optimizer's loss leaves the other parameters without gradients."""
        manual = self._manual(required="toggle_optimizer")
        manual.toggle(_index_of(manual, optimizer))

    def untoggle_optimizer(self, optimizer: Any) -> None:
        self._manual(required="untoggle_optimizer").untoggle()

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``toggle_optimizer`` inside, ``untoggle_optimizer`` after."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def _manual(self, required: str | None = None) -> ManualStep | None:
        loop = self._trainer.fit_loop if self._trainer is not None else None
        step = loop.step if loop is not None else None
        if isinstance(step, ManualStep):
            return step
        if required is not None:
            raise RuntimeError(f"{required} needs manual optimization during fit: set self.automatic_optimization = "
                               "False in __init__.")
        return None

    def freeze(self) -> None:
        """No gradients for any parameter, and eval mode."""
        for param in self.parameters():
            param.requires_grad_(False)
        self.eval()

    def unfreeze(self) -> None:
        for param in self.parameters():
            param.requires_grad_(True)
        self.train()


def _index_of(manual: ManualStep, optimizer: Any) -> int:
    """The index of ``optimizer`` (a wrapper from ``optimizers()`` or the optimizer itself) among the run's."""
    target = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
    for index, candidate in enumerate(manual.config.optimizers):
        if candidate is target:
            return index
    raise ValueError(f"{type(target).__name__} is not one of the optimizers configure_optimizers returned.")
