"""The training loop (epochs, micro-batches, optimizer steps) and the evaluation loop.

Loss normalisation (DESIGN.md, "Accumulation"): a micro-batch's step returns a loss that is the mean
over its ``n`` items (``n = 1`` when no ``num_items`` is given). The objective of one optimizer step is
``sum_i n_i L_i / N`` over the window's micro-batches on every rank, ``N = sum_i n_i``. Each
micro-batch back-propagates ``L_i * n_i / c``, and after the cross-rank sum the strategy multiplies
gradients by ``c / N`` once. ``c`` must be the same on every rank (the sum mixes their gradients): for
plain losses it is the accumulation factor ``k``; with ``num_items`` it is fixed for the whole run at
``k`` times the largest first micro-batch count over ranks (one scalar collective, once), which keeps
gradients near unit scale for fp16. A short final window is exact because ``N`` is what it held.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from trainkit.data import ResumableSampler, num_batches
from trainkit_strategies import RunsSchedule

if TYPE_CHECKING:
    from trainkit.trainer import Trainer


def _unpack(output: Any) -> tuple[Tensor | None, Any]:
    if output is None or isinstance(output, Tensor):
        return output, None
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError("training_step returned a dict without a 'loss' key.")
        return output["loss"], output.get("num_items")
    raise TypeError(f"training_step must return a loss tensor, a dict with 'loss', or None; got {type(output)}.")


def _iterate(loader: Iterable[Any], epoch: int, seed: int, skip_batches: int) -> Iterator[Any]:
    """An epoch's batches, starting ``skip_batches`` in; ResumableSampler skips without loading."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        sampler.set_epoch(epoch)
        sampler.skip(skip_batches * loader.batch_size)
        if loader.generator is not None:
            loader.generator.manual_seed(seed * 1_000_003 + epoch)
        return iter(loader)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(skip_batches):
        next(it)
    return it


def _exhaust(batches: Iterator[Any]) -> None:
    """Ask a finished epoch's iterator for one more batch, as a ``for`` loop does before it stops: torch's
    RandomSampler draws once more from its generator when it runs out, so a loader with a seeded
    ``generator`` shuffles the next epoch as in a hand-written loop. One call, so an iterator whose
    length undercounts it is not drained."""
    next(batches, None)


class FitLoop:
    """Epochs of micro-batches grouped into optimizer steps; its state is what checkpoints resume."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.epoch = 0
        self.global_step = 0
        self.batch_idx = 0  # batches of the current epoch consumed by completed optimizer steps
        self.epoch_done = False
        self.total_batches = 0  # batches consumed by completed optimizer steps, all epochs
        self._val_marker = 0  # validations done on the current interval count (see _val_schedule)
        self._window = 0
        self._window_count: Any = 0  # micro-batches (plain losses) or items (num_items) in the window
        self._item_weighted = False
        self._items_norm: float | None = None  # c: k times the first micro-batch's item count (max over ranks)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "global_step": self.global_step, "batch_idx": self.batch_idx,
                "epoch_done": self.epoch_done, "val_marker": self._val_marker, "items_norm": self._items_norm,
                "total_batches": self.total_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self.batch_idx, self.epoch_done = state["batch_idx"], state["epoch_done"]
        self._val_marker = state.get("val_marker", 0)
        self._items_norm = state.get("items_norm")
        self.total_batches = state.get("total_batches", 0)
        if self.epoch_done:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch, self.batch_idx, self.epoch_done = self.epoch + 1, 0, False
        if self.trainer.check_val_every_n_epoch is not None:
            self._val_marker = 0

    @property
    def done(self) -> bool:
        t = self.trainer
        return (
            t.should_stop
            or (0 <= t.max_steps <= self.global_step)
            or (t.max_epochs is not None and self.epoch >= t.max_epochs)
        )

    def run(self) -> None:
        t = self.trainer
        t._call("on_fit_start")
        if t.num_sanity_val_steps and t.val_dataloaders and self._has_validation():
            limit = None if t.num_sanity_val_steps < 0 else t.num_sanity_val_steps
            t.eval_loop.run("validate", t.val_dataloaders, limit, sanity=True)
        t._call("on_train_start")
        while not self.done:
            self.run_epoch()
        t._call("on_train_end")
        t._call("on_fit_end")

    def _has_validation(self) -> bool:
        from trainkit.module import TrainModule

        module = self.trainer.module
        scheduled = isinstance(self.trainer.strategy, RunsSchedule)
        if scheduled and callable(getattr(module, "pipeline_validation_step", None)):
            return True  # pipeline_validation_step alone asks for validation under pipeline
        return type(module).validation_step is not TrainModule.validation_step

    def run_epoch(self) -> None:
        t = self.trainer
        module = t.module
        loader = t.train_dataloader
        assert loader is not None and module is not None
        limit = num_batches(loader, t.limit_train_batches)
        val_every = self._val_schedule(limit)
        k = t.accumulate_grad_batches
        module.train()
        t._results.stage = "train"
        t._call("on_train_epoch_start")
        batches = _iterate(loader, self.epoch, t.seed or 0, self.batch_idx)
        t._apply_pending_rng()
        batch_idx = self.batch_idx
        self._window = 0
        hooks = t._hooks
        batch_start, batch_end = hooks["on_train_batch_start"], hooks["on_train_batch_end"]
        device_needed = t._moves_batches
        while batch_idx < limit and not self.done:
            try:
                batch = next(batches)
            except StopIteration:
                break
            if device_needed:
                batch = t.to_device(batch)
            for fn in batch_start:
                fn(batch, batch_idx)
            t._results.batch = batch
            boundary = self._window + 1 == k or batch_idx + 1 >= limit
            outputs = self._micro_step(batch, batch_idx, boundary, k)
            batch_idx += 1
            if boundary:
                self._finish_step(batch_idx, val_every)
            for fn in batch_end:
                fn(outputs, batch, batch_idx - 1)
        if batch_idx != self.batch_idx:  # a window cut short by the data (no length known, or fewer batches)
            self._finish_step(batch_idx, val_every)
        if self.done and batch_idx < limit:
            return
        if t.limit_train_batches is None:
            _exhaust(batches)
        if math.isinf(val_every) and self._validation_epoch():
            t.eval_loop.run("validate", t.val_dataloaders, t.limit_val_batches)
            t._results.stage = "train"
        self.epoch_done = True
        t._results.epoch_end = True  # self.log in the module's epoch-end hook aggregates per epoch
        t._call_module("on_train_epoch_end")
        t._results.epoch_end = False
        self._log(t._results.epoch_metrics())
        self._step_scheduler("epoch", self.epoch + 1)  # before the callbacks: epoch-end checkpoints include it
        t._call_callbacks("on_train_epoch_end")
        self._next_epoch()

    def _scheduled_step(self, batch: Any, boundary: bool, k: int) -> Any:
        """A strategy that runs its own schedule (pipeline): it weights every loss item by 1/k (times the
        loss scale) and reports the items its rank counted, so the boundary normalises by their total."""
        t = self.trainer
        strategy = t.strategy
        assert isinstance(strategy, RunsSchedule)
        if self._window == 0:
            self._item_weighted = True
        self._items_norm = float(k)
        weight = 1.0 / k if t.scaler is None else t.scaler.scale / k
        with nullcontext() if boundary else t.strategy.no_sync():
            loss, items = strategy.run_schedule(t.module, batch, weight)
        for fn in t._hooks["on_after_backward"]:
            fn()
        self._window_count = self._window_count + items
        t._last_loss = loss
        t._results.log("train_loss", loss, True, True, True, False, "mean", False, None)  # no training_step ran
        self._window += 1
        return {"loss": loss, "num_items": items}

    def _micro_step(self, batch: Any, batch_idx: int, boundary: bool, k: int) -> Any:
        t = self.trainer
        strategy, module = t.strategy, t.module
        if isinstance(strategy, RunsSchedule):
            return self._scheduled_step(batch, boundary, k)
        sync = nullcontext() if boundary else strategy.no_sync()
        with sync:
            with strategy.forward_context():
                outputs = module.training_step(batch, batch_idx)
            loss, n = _unpack(outputs)
            if loss is None:
                if t.world_size > 1:
                    raise RuntimeError("training_step returned None under a distributed strategy; every rank "
                                       "must produce a loss at every step (return a zero loss to skip).")
                return outputs
            if self._window == 0:
                self._item_weighted = n is not None
            elif (n is not None) != self._item_weighted:
                raise ValueError("training_step returned num_items for some micro-batches of a window but not "
                                 "for others; return it always or never.")
            if n is None:
                weight: Any = 1.0 / k
                self._window_count += 1
            else:
                if self._items_norm is None:
                    first = torch.as_tensor(n, dtype=torch.float64, device=strategy.device).clamp(min=1)
                    self._items_norm = float(strategy.reduce(first, "max")) * k
                self._window_count = self._window_count + n
                weight = n / self._items_norm
            if t.scaler is not None:
                weight = weight * t.scaler.scale
            for fn in t._hooks["on_before_backward"]:
                fn(loss)
            strategy.backward(loss * weight if not (isinstance(weight, float) and weight == 1.0) else loss)
            for fn in t._hooks["on_after_backward"]:
                fn()
        t._last_loss = loss.detach()
        self._window += 1
        return outputs

    def _finish_step(self, batch_idx: int, val_every: float) -> None:
        """The optimizer boundary: normalise, reduce, (unscale, check), clip, step, zero."""
        t = self.trainer
        strategy = t.strategy
        self.total_batches += batch_idx - self.batch_idx
        self.batch_idx = batch_idx
        if self._window == 0:  # every micro-batch of the window returned None: nothing to step
            return
        count = self._window_count
        if not self._item_weighted:
            scale: Any = t.accumulate_grad_batches / (count * strategy.world_size)
        else:
            total = torch.as_tensor(count, dtype=torch.float64, device=strategy.device)
            scale = (self._items_norm / strategy.reduce(total, "sum").clamp(min=1)).float()
        self._window, self._window_count = 0, 0
        if t.scaler is not None:
            scale = scale / t.scaler.scale
        strategy.reduce_gradients(scale)
        optimizer = strategy.optimizer
        norm_value = None
        skip = False
        if t.scaler is not None:
            norm_value = strategy.grad_norm()
            skip = not bool(torch.isfinite(norm_value))
            t.scaler.update(found_inf=skip)
        if not skip:
            for fn in t._hooks["on_before_optimizer_step"]:
                fn(optimizer)
            if t.gradient_clip_val is not None:
                if t.gradient_clip_algorithm == "norm":
                    strategy.clip_grad_norm(t.gradient_clip_val, norm=norm_value)
                else:
                    strategy.clip_grad_value(t.gradient_clip_val)
            strategy.optimizer_step()
        for fn in t._hooks["on_before_zero_grad"]:
            fn(optimizer)
        strategy.zero_grad()
        self.global_step += 1
        if not skip:  # a step skipped for overflow does not advance the LR schedule
            self._step_scheduler("step", self.global_step)
        if self.global_step % t.log_every_n_steps == 0:
            self._log(t._results.step_metrics())
        counted = self.total_batches if t.check_val_every_n_epoch is None else batch_idx
        if counted // val_every > self._val_marker and self._validation_epoch():
            self._val_marker = int(counted // val_every)
            t.eval_loop.run("validate", t.val_dataloaders, t.limit_val_batches)
            t._results.stage = "train"

    def _step_scheduler(self, interval: str, count: int) -> None:
        """Step the LR scheduler if it runs on this ``interval`` and ``count`` hits its frequency."""
        cfg = self.trainer.optimizer_config
        if cfg is None or cfg.scheduler is None or cfg.interval != interval or count % cfg.frequency:
            return
        if isinstance(cfg.scheduler, ReduceLROnPlateau):
            metrics = self.trainer._results.local_values(prog_bar_only=False)
            if cfg.monitor not in metrics:
                raise KeyError(f"ReduceLROnPlateau monitors {cfg.monitor!r}, which was not logged; "
                               f"logged: {sorted(metrics)}.")
            cfg.scheduler.step(metrics[cfg.monitor])
        else:
            cfg.scheduler.step()

    def _val_schedule(self, limit: float) -> float:
        """Training batches between validations, or inf to validate at epoch ends only.

        As in Lightning: a float is a fraction of the epoch; an int counts batches within the epoch (it
        may not exceed the epoch) unless ``check_val_every_n_epoch`` is None, in which case it counts
        batches across epochs (iteration-based training).
        """
        t = self.trainer
        interval = t.val_check_interval
        if not t.val_dataloaders or not self._has_validation() or interval is None:
            return math.inf
        if isinstance(interval, float) and interval <= 1.0:
            if interval == 1.0:
                return math.inf
            if math.isinf(limit):
                raise ValueError("A fractional val_check_interval needs a training dataloader with a length.")
            return max(1, int(limit * interval))
        if t.check_val_every_n_epoch is not None and interval > limit:
            raise ValueError(
                f"val_check_interval={interval} exceeds the {int(limit)} training batches of an epoch, so validation "
                "would never run. Lower it, or set check_val_every_n_epoch=None to count batches across epochs."
            )
        return int(interval)

    def _validation_epoch(self) -> bool:
        t = self.trainer
        if not t.val_dataloaders or not self._has_validation():
            return False
        return t.check_val_every_n_epoch is None or (self.epoch + 1) % t.check_val_every_n_epoch == 0

    def _log(self, metrics: dict[str, float]) -> None:
        if metrics:
            self.trainer.log_metrics(metrics, self.global_step)
            if self.trainer.is_global_zero:
                for lg in self.trainer.loggers:
                    lg.save()


class EvalLoop:
    """Validation, test and prediction: no gradients, module in eval mode, per-epoch aggregates."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _batches(self, loaders: Sequence[DataLoader], limit: int | float | None) -> Iterator[tuple[int, int, Any]]:
        t = self.trainer
        device_needed = t._moves_batches
        for dl_idx, loader in enumerate(loaders):
            n = num_batches(loader, limit)
            for batch_idx, batch in enumerate(_iterate(loader, 0, t.seed or 0, 0)):
                if batch_idx >= n:
                    break
                yield dl_idx, batch_idx, t.to_device(batch) if device_needed else batch

    def run(self, stage: str, loaders: Sequence[DataLoader], limit: int | float | None,
            sanity: bool = False) -> dict[str, float]:
        t = self.trainer
        module = t.module
        assert module is not None
        step_fn = module.validation_step if stage == "validate" else module.test_step
        prefix = "validation" if stage == "validate" else "test"
        was_training = module.training
        module.eval()
        t._results.stage = stage
        t._results.reset(stage)
        t.sanity_checking = sanity
        if not sanity:
            t._call(f"on_{prefix}_start")
            t._call(f"on_{prefix}_epoch_start")
        batch_end = t._hooks[f"on_{prefix}_batch_end"] if not sanity else []
        multi = len(loaders) > 1
        scheduled = isinstance(t.strategy, RunsSchedule)
        with torch.no_grad(), t.strategy.forward_context():
            for dl_idx, batch_idx, batch in self._batches(loaders, limit):
                t._results.batch = batch
                if scheduled:
                    out = self._scheduled_eval(batch, batch_idx)
                elif multi:
                    out = step_fn(batch, batch_idx, dataloader_idx=dl_idx)
                else:
                    out = step_fn(batch, batch_idx)
                for fn in batch_end:
                    fn(out, batch, batch_idx)
        if not sanity:
            t._call(f"on_{prefix}_epoch_end")
        metrics = t._results.epoch_metrics()
        if sanity:
            t._results.reset(stage)
        else:
            t.log_metrics(metrics, t.global_step)
            t._call(f"on_{prefix}_end")
        t.sanity_checking = False
        if was_training:
            module.train()
        return metrics

    def _scheduled_eval(self, batch: Any, batch_idx: int) -> dict[str, Tensor] | None:
        """Pipeline evaluation: the last stage's metrics, identical on a pipeline's ranks, logged by all."""
        t = self.trainer
        assert isinstance(t.strategy, RunsSchedule)
        metrics = t.strategy.eval_schedule(t.module, batch, batch_idx, t.state)
        for name, value in (metrics or {}).items():
            t._results.log(name, value, True, True, False, True, "mean", True, None)
        return metrics

    def predict(self, loaders: Sequence[DataLoader], limit: int | float | None) -> list[Any]:
        t = self.trainer
        module = t.module
        assert module is not None
        module.eval()
        t._results.stage = "predict"
        t._call("on_predict_start")
        t._call("on_predict_epoch_start")
        outputs = []
        batch_end = t._hooks["on_predict_batch_end"]
        with torch.no_grad(), t.strategy.forward_context():
            for _, batch_idx, batch in self._batches(loaders, limit):
                out = module.predict_step(batch, batch_idx)
                for fn in batch_end:
                    fn(out, batch, batch_idx)
                outputs.append(out)
        t._call("on_predict_epoch_end")
        t._call("on_predict_end")
        return outputs
