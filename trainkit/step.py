"""The optimizer step as one component: the accumulation window, loss normalisation, loss scaling, the
overflow skip, clipping, the step itself and the LR schedule.

Loss normalisation: a micro-batch's step returns a loss that is the mean over its ``n`` items: the
``num_items`` it returns, or else its samples (the batch's leading dimension). The objective of one optimizer
step is ``sum_i n_i L_i / N`` over the window's micro-batches on every rank, ``N = sum_i n_i``: a window of
batches of 4, 4 and 2 samples steps exactly like one batch of those 10. Each micro-batch back-propagates
``L_i * n_i / c``, and after the cross-rank sum the strategy multiplies gradients by ``c / N`` once. ``c`` must
be the same on every rank (the sum mixes their gradients): it is fixed for the whole run at ``k`` times the
largest first micro-batch count over ranks (one scalar collective, once), which keeps gradients near unit scale
for fp16. A short final window is exact because ``N`` is what it held.

``N`` is summed over ranks on the device (the count becomes a device scalar by a fill, never by copying Python
data, so the step never waits for the host), except where it needs no communication: on one rank, and for
sample counts when every rank's batches hold as many samples (trainkit's sampler pads each rank's share to the
same length), where it is ``W`` times this rank's count.

A strategy that can step during backward (``StepsInBackward``: ZeRO-Offload's host step, bucket by bucket as the
gradients land) is offered the window's ``c / N`` just before the window's last backward, when nothing needs the
gradients before the step: no clipping, no loss scaler, no ``on_before_optimizer_step`` hook. The count is complete
by then (every micro-batch's items are known before its backward), so the offered scale is the one the boundary
passes to ``reduce_gradients``.

A strategy that runs its own schedule (``RunsSchedule``: the pipeline) computes forward and backward
of a batch itself; it weights every loss item by ``1/k`` (times the loss scale) and reports the items
its rank counted, so the boundary normalises by their total with ``c = k``. Which of the two forward
paths a step uses is decided once, when it is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from trainkit.dispatch import HookDispatch
from trainkit.finite import FiniteGuard
from trainkit.hooks import StepTiming
from trainkit.optim import OptimizerConfig
from trainkit.utils import infer_batch_size
from trainkit_strategies import Precision, RunsSchedule, StepsInBackward, Strategy, capability
from trainkit_strategies.communication.liveness import activity
from trainkit_strategies.experts.auxiliary import collecting, with_auxiliary


@dataclass(frozen=True)
class StepConfig:
    """Attributes:
        accumulate_grad_batches: micro-batches per optimizer step (``k``).
        gradient_clip_val: clip at this value (None: no clipping).
        gradient_clip_algorithm: "norm" (global norm across shards and stages) or "value".
    """

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"


class WindowStep(Protocol):
    """What the fit loop drives: ``OptimizerStep`` (automatic optimization) and ``manual.ManualStep``."""

    k: int  # micro-batches per window the loop counts (1 under manual optimization: the user's windows)
    window: int  # micro-batches run in the open window
    taken: int  # optimizer steps the last closed window counts for
    items_norm: float | None  # kept in the loop's checkpoint state
    last_loss: Tensor | None
    timing: StepTiming
    guard: FiniteGuard
    with_batch_idx: bool  # training_step takes batch_idx

    def micro_step(self, module: nn.Module, batch: Any, batch_idx: int, boundary: bool) -> Any: ...

    def step(self) -> bool | None: ...

    def step_scheduler(self, interval: str, count: int, metrics: Callable[[], dict[str, float]]) -> None: ...

    def release(self) -> None: ...


def unpack_output(output: Any) -> tuple[Tensor | None, Any]:
    """``training_step``'s return value as ``(loss, num_items)``."""
    if output is None or isinstance(output, Tensor):
        return output, None
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError("training_step returned a dict without a 'loss' key.")
        return output["loss"], output.get("num_items")
    raise TypeError(f"training_step must return a loss tensor, a dict with 'loss', or None; got {type(output)}.")


class OptimizerStep:
    """Runs micro-batches into an accumulation window and closes it with one optimizer step (automatic optimization;
    ``manual.py`` has the manual one's).

    Args:
        strategy: does backward, reduction, clipping and the step.
        config: accumulation and clipping.
        precision: the precision policy: its loss scale weights each loss, and it decides a step skipped.
        hooks: dispatch of the backward/step hooks (``on_before_backward`` ... ``on_before_zero_grad``).
        optimizers: the optimizer and LR schedulers from ``configure_optimizers``.
        log_loss: where a schedule-running strategy's batch loss is logged as ``train_loss`` (no
            ``training_step`` runs to log it).
        equal_batches: every rank's micro-batches hold as many samples as this rank's (the data comes through
            trainkit's sampler), so a plain loss's sample total needs no communication.
        guard: notices non-finite losses and gradient norms (``finite.py``), and under ``on_nonfinite="skip"``
            decides which steps are skipped.
    """

    taken = 1  # optimizer steps a closed window counts for (several under manual optimization)

    def __init__(self, strategy: Strategy, config: StepConfig, precision: Precision,
                 hooks: HookDispatch, optimizers: OptimizerConfig | None = None,
                 log_loss: Callable[[Tensor], None] | None = None, equal_batches: bool = False,
                 guard: FiniteGuard | None = None) -> None:
        self.strategy, self.config, self.precision, self.hooks = strategy, config, precision, hooks
        self.guard = guard if guard is not None else FiniteGuard(strategy, "stop", 10, 50)  # the Trainer's defaults
        self.optimizers, self.log_loss = optimizers, log_loss
        self.equal_batches = equal_batches  # every rank's batches hold as many samples (trainkit's sampler)
        self.k = config.accumulate_grad_batches
        self.window = 0  # micro-batches run in the open window
        self.items_norm: float | None = None  # c (see the module docstring); kept in checkpoints
        self.last_loss: Tensor | None = None
        self.timing = StepTiming(0.0, 0.0)  # the last closed window's
        self._forward_backward_s = 0.0  # in the open window
        self._count: Any = 0  # micro-batches (plain losses) or items (num_items) in the window
        self._item_weighted = False
        self._boundary = False  # the micro-batch running is its window's last
        self._early_scale: Any = None  # the window's scale, when the strategy took it to step during backward
        # a strategy may step during the window's last backward when nothing needs the gradients before the step
        early = capability(strategy, StepsInBackward)
        self._early = early if (early is not None and not precision.loss_scaling and config.gradient_clip_val is None
                                and not hooks.fns("on_before_optimizer_step")) else None
        clip = config.gradient_clip_val
        self._clip = None if clip is None else (clip, config.gradient_clip_algorithm)
        self._schedule = capability(strategy, RunsSchedule)  # a pipeline's: forward and backward of a whole batch
        self._forward_backward = self._training_step if self._schedule is None else self._scheduled
        self.with_batch_idx = True  # training_step takes batch_idx (the fit loop asks once: ``takes_batch_idx``)

    # -- micro-batches -------------------------------------------------------------------------------
    def micro_step(self, module: nn.Module, batch: Any, batch_idx: int, boundary: bool) -> Any:
        """Forward and backward of one micro-batch; ``boundary``: it is the window's last (gradients sync)."""
        start = time.perf_counter()
        if self.window == 0:
            self._forward_backward_s = 0.0
        self._boundary = boundary
        try:
            with nullcontext() if boundary else self.strategy.no_sync():
                return self._forward_backward(module, batch, batch_idx)
        finally:
            self._forward_backward_s += time.perf_counter() - start

    def _training_step(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        strategy = self.strategy
        batch = strategy.local_batch(batch)  # under context parallelism: this rank's chunks of every sequence
        with strategy.forward_context(), collecting(module) as auxiliary:  # terms layers add (a MoE's balance loss)
            outputs = module.training_step(batch, batch_idx) if self.with_batch_idx else module.training_step(batch)
        loss, n = unpack_output(outputs)
        if loss is None:
            if strategy.world_size > 1:
                raise RuntimeError("training_step returned None under a distributed strategy; every rank "
                                   "must produce a loss at every step (return a zero loss to skip).")
            return outputs
        if self.window == 0:
            self._item_weighted = n is not None
        elif (n is not None) != self._item_weighted:
            raise ValueError("training_step returned num_items for some micro-batches of a window but not "
                             "for others; return it always or never.")
        if n is None:
            n = infer_batch_size(batch) or 1  # a plain mean loss weighs by its samples
        if self.items_norm is None:
            self.items_norm = self._first_norm(n)
        self._count = self._count + n
        weight: Any = n / self.items_norm
        if self.precision.loss_scaling:
            weight = weight * self.precision.loss_scale
        for fn in self.hooks.fns("on_before_backward"):
            fn(loss)
        if self._boundary and self._early is not None:
            scale = self._window_scale(self._count)
            if self._early.step_in_backward(scale):
                self._early_scale = scale
        objective = with_auxiliary(loss, auxiliary)
        activity.enter("backward")
        strategy.backward(objective * weight if not (isinstance(weight, float) and weight == 1.0) else objective)
        for fn in self.hooks.fns("on_after_backward"):
            fn()
        self.last_loss = loss.detach()
        self.guard.add_loss(self.last_loss)
        self.window += 1
        return outputs

    def _first_norm(self, n: Any) -> float:
        """``c``: ``k`` times the largest first micro-batch count over the ranks (once per run)."""
        strategy = self.strategy
        if isinstance(n, Tensor) or (strategy.world_size > 1 and (self._item_weighted or not self.equal_batches)):
            first = _on_device(n, strategy.device).clamp(min=1)
            return float(strategy.reduce(first, "max")) * self.k
        return max(float(n), 1.0) * self.k

    def _scheduled(self, module: nn.Module, batch: Any, batch_idx: int) -> Any:
        assert self._schedule is not None
        if self.window == 0:
            self._item_weighted = True
        self.items_norm = float(self.k)
        weight = self.precision.loss_scale / self.k
        loss, items = self._schedule.run_schedule(module, batch, weight)
        for fn in self.hooks.fns("on_after_backward"):
            fn()
        self._count = self._count + items
        self.last_loss = loss
        if isinstance(loss, Tensor):
            self.guard.add_loss(loss.detach())
        if self.log_loss is not None:
            self.log_loss(loss)
        self.window += 1
        return {"loss": loss, "num_items": items}

    def release(self) -> None:
        """Nothing to take off when the fit ends (``ManualStep`` hooks the parameters)."""

    # -- the boundary --------------------------------------------------------------------------------
    def step(self) -> bool | None:
        """Close the window: normalise, reduce, (unscale, check), clip, step, zero, advance a per-step LR
        schedule. Returns None when the window ran no backward (nothing to step), False when the step was
        skipped for an fp16 overflow (every rank skips together), True otherwise."""
        if self.window == 0:
            return None
        start = time.perf_counter()
        stepped = self._step()
        self.timing = StepTiming(self._forward_backward_s, time.perf_counter() - start, skipped=not stepped)
        return stepped

    def _step(self) -> bool:
        activity.enter("the optimizer step")  # the gradients' reduction included: where peers wait for a slow rank
        strategy = self.strategy
        count, self.window, self._count = self._count, 0, 0
        scale, self._early_scale = self._early_scale, None
        if scale is None:
            scale = self._window_scale(count)
        return close_window(strategy, self.precision, self.guard, self.hooks, scale, strategy.optimizer, self._clip,
                            strategy.optimizer_step)

    def _window_scale(self, count: Any) -> Any:
        """``c / N`` for a window that counted ``count`` here (summed over the ranks where it must be), with the loss
        scaler's unscale folded in."""
        strategy = self.strategy
        assert self.items_norm is not None
        if isinstance(count, Tensor) or (strategy.world_size > 1 and (self._item_weighted or not self.equal_batches)):
            total = strategy.reduce(_on_device(count, strategy.device), "sum")
            scale: Any = (self.items_norm / total.clamp(min=1)).float()
        else:  # one rank, or as many samples on every rank that counts items
            scale = self.items_norm / max(float(count) * strategy.item_ranks, 1.0)
        return scale / self.precision.loss_scale if self.precision.loss_scaling else scale

    def step_scheduler(self, interval: str, count: int, metrics: Callable[[], dict[str, float]]) -> None:
        """Step each LR scheduler that runs on this ``interval`` ("step" or "epoch") where ``count`` hits its
        frequency; ``metrics`` gives ReduceLROnPlateau its monitored value."""
        for cfg in self.optimizers.schedulers if self.optimizers is not None else ():
            if cfg.interval != interval or count % cfg.frequency:
                continue
            if isinstance(cfg.scheduler, ReduceLROnPlateau):
                values = metrics()
                if cfg.monitor not in values:
                    raise KeyError(f"ReduceLROnPlateau monitors {cfg.monitor!r}, which was not logged; "
                                   f"logged: {sorted(values)}.")
                cfg.scheduler.step(values[cfg.monitor])
            else:
                cfg.scheduler.step()


def close_window(strategy: Strategy, precision: Precision, guard: FiniteGuard, hooks: HookDispatch,
                 scale: float | Tensor, optimizer: Any, clip: tuple[float, str] | None, step: Callable[[], None],
                 zero_hooks: bool = True) -> bool:
    """The boundary of a window, for both kinds of optimization: reduce the gradients (times ``scale``); under loss
    scaling unscale-check them (a global norm: every rank decides alike), or under ``on_nonfinite="skip"`` check
    their norm; ``on_before_optimizer_step``; clip (``(value, "norm" | "value")``); ``step``; the zero-grad hooks
    (automatic optimization's) and ``strategy.zero_grad()``. Returns whether the step ran."""
    strategy.reduce_gradients(scale)
    skip, norm = precision.skips_step(strategy.grad_norm)
    if skip:
        guard.overflowed()
    elif not guard.records:  # on_nonfinite="skip"
        norm = strategy.grad_norm() if norm is None else norm
        skip = guard.skip_step(norm)
    else:
        guard.skips = 0
    if not skip:
        for fn in hooks.fns("on_before_optimizer_step"):
            fn(optimizer)
        if clip is not None:
            if clip[1] == "norm":
                norm = strategy.clip_grad_norm(clip[0], norm=norm)
            else:
                strategy.clip_grad_value(clip[0])
        guard.add_norm(norm)
        step()
    if zero_hooks:
        for fn in hooks.fns("on_before_zero_grad"):
            fn(optimizer)
    strategy.zero_grad()
    return not skip


def _on_device(count: Any, device: torch.device) -> Tensor:
    """A count (a Python number or a tensor) as a float64 scalar on ``device``: a Python number by a fill kernel,
    which needs no copy from host memory (``torch.tensor(x, device=...)`` copies, and waits for the copy)."""
    if isinstance(count, Tensor):
        return count.detach().to(device=device, dtype=torch.float64)
    return torch.full((), float(count), dtype=torch.float64, device=device)
