"""What ``TrainModule.log`` records, and when it becomes numbers.

Logging a tensor costs a dict write (per-step values) or one fused add (per-epoch aggregates); values
turn into Python floats, and are reduced across ranks when ``sync_dist`` asks, only at points every
rank reaches together: the logging interval and the end of an epoch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torchmetrics import Metric

from trainkit.utils import infer_batch_size

_REDUCE_FX = ("mean", "sum", "max", "min")


def _is_metric(value: Any) -> bool:
    """Whether ``value`` is a torchmetrics Metric, without importing torchmetrics (0.6 s with transformers
    installed, paid by every rank at start): a value cannot be a Metric unless its user imported the library."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


@dataclass
class _Entry:
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce_fx: str
    sync_dist: bool
    last: Any = None
    last_weight: float = 1.0  # the latest value's batch_size (its items), for the mean over context-parallel ranks
    total: Tensor | None = None
    weight: float = 0.0
    metric: Metric | None = None
    epoch_value: float | None = None
    stamp: int = -1  # ``Results.boundary`` when ``last`` was logged
    fresh: bool = False  # ``last`` was logged since ``fresh_step_metrics`` last looked
    epoch_stamp: int = -1  # ... when ``epoch_value`` was computed


class Results:
    """Logged values, kept per loop ("train", "validate", "test", "predict"); ``loop`` is the running one."""

    def __init__(self, reduce: Callable[[Tensor, str], Tensor],
                 reduce_tokens: Callable[[Tensor, str], Tensor | None] = lambda t, op: None) -> None:
        self._reduce = reduce
        # values a rank logs describe its chunks of the samples under context parallelism: those without sync_dist
        # are combined over the ranks holding the other chunks (weighted by batch_size) before they become numbers
        self._reduce_tokens = reduce_tokens
        self.loop = "train"
        self.batch: Any = None  # the batch being processed: epoch means weight by its size by default
        self.epoch_end = False  # inside an epoch-end hook: values default to per-epoch
        self.boundary = 0  # the training loop counts its step boundaries: what was logged since belongs to this step
        self._entries: dict[str, dict[str, _Entry]] = {}

    @property
    def entries(self) -> dict[str, _Entry]:
        return self._entries.setdefault(self.loop, {})

    def reset(self, loop: str) -> None:
        self._entries[loop] = {}

    def log(
        self, name: str, value: Any, *, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
        on_epoch: bool | None = None, reduce_fx: str = "mean", sync_dist: bool = False, batch_size: int | None = None,
    ) -> None:
        """Record ``value`` under ``name`` (the options are ``TrainModule.log``'s)."""
        entries = self.entries
        entry = entries.get(name)
        if entry is None:
            if reduce_fx not in _REDUCE_FX:
                raise ValueError(f"self.log({name!r}): reduce_fx={reduce_fx!r}; choose one of {_REDUCE_FX}.")
            training = self.loop == "train" and not self.epoch_end
            entry = entries[name] = _Entry(
                prog_bar, logger, training if on_step is None else on_step,
                (not training) if on_epoch is None else on_epoch, reduce_fx, sync_dist,
            )
        entry.stamp, entry.fresh = self.boundary, True
        if _is_metric(value):
            entry.metric = value
            entry.last = value._forward_cache
            return
        if isinstance(value, Tensor):
            value = value.detach()
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}) needs a scalar; got a tensor of shape {tuple(value.shape)}.")
        elif not isinstance(value, int | float):
            raise TypeError(f"self.log({name!r}) needs a number, a scalar tensor or a Metric; got {type(value)}.")
        entry.last = value
        entry.last_weight = 1.0 if batch_size is None else float(batch_size)
        if entry.on_epoch:
            if batch_size is None:
                batch_size = infer_batch_size(self.batch) or 1
            weight = float(batch_size)
            # aggregate on the device of the first value (a CUDA loss stays on the GPU, no sync per step)
            device = entry.total.device if entry.total is not None else None
            value = torch.as_tensor(value, dtype=torch.float64, device=device).reshape(())
            fx = entry.reduce_fx
            if entry.total is None:
                entry.total = value * weight if fx == "mean" else value.clone()
            elif fx == "mean":
                entry.total = entry.total + value * weight
            elif fx == "sum":
                entry.total = entry.total + value
            elif fx == "max":
                entry.total = torch.maximum(entry.total, value)
            else:
                entry.total = torch.minimum(entry.total, value)
            entry.weight += weight

    def _float(self, value: Any, entry: _Entry) -> float:
        if isinstance(value, Tensor):
            if entry.sync_dist:
                value = self._reduce(value.float(), entry.reduce_fx)
            else:
                value = self._over_tokens(value.float(), entry.last_weight, entry.reduce_fx)
            return float(value.item())
        return float(value)

    def _over_tokens(self, value: Tensor, weight: float, fx: str) -> Tensor:
        """``value`` combined over the context-parallel ranks (the mean weighted by ``weight``); as it is elsewhere."""
        if fx != "mean":
            reduced = self._reduce_tokens(value, fx)
            return value if reduced is None else reduced
        pair = self._reduce_tokens(torch.stack([value.reshape(()) * weight,
                                                torch.full((), weight, dtype=value.dtype, device=value.device)]),
                                   "sum")
        return value if pair is None else pair[0] / pair[1]

    def step_metrics(self, logger_only: bool = True) -> dict[str, float]:
        """Latest per-step values (reduced when ``sync_dist``): call at a point every rank reaches."""
        out = {}
        for name, e in self.entries.items():
            if e.on_step and e.last is not None and (e.logger or not logger_only):
                out[f"{name}_step" if e.on_epoch else name] = self._float(e.last, e)
        return out

    def fresh_step_metrics(self) -> dict[str, float]:
        """The per-step values logged since the last call, for the loggers (``<name>_step`` when also per-epoch): an
        evaluation loop's per-batch curve. This rank's own values, over the context-parallel ranks of its samples
        only: the data-parallel ranks may hold different numbers of evaluation batches (``EvalLoop``)."""
        out = {}
        for name, e in self.entries.items():
            if not e.fresh:
                continue
            e.fresh = False
            if e.on_step and e.logger and e.last is not None:
                value = e.last
                out[f"{name}_step" if e.on_epoch else name] = float(
                    self._over_tokens(value.float(), e.last_weight, e.reduce_fx)) if isinstance(value, Tensor) \
                    else float(value)
        return out

    def epoch_metrics(self) -> dict[str, float]:
        """Aggregate and clear the running loop's per-epoch values; every rank must call it."""
        out = {}
        for name, e in self.entries.items():
            if not e.on_epoch:
                continue
            key = f"{name}_epoch" if e.on_step else name
            if e.metric is not None and e.metric.update_count:
                out[key] = float(e.metric.compute())
                e.metric.reset()
            elif e.total is not None:
                total, weight = e.total, e.weight
                if e.sync_dist:
                    if e.reduce_fx == "mean":
                        weights = torch.tensor(weight, dtype=total.dtype, device=total.device)
                        pair = self._reduce(torch.stack([total, weights]), "sum")
                        total, weight = pair[0], pair[1]
                    else:
                        total = self._reduce(total, e.reduce_fx)
                elif e.reduce_fx == "mean":  # over the context-parallel ranks, if any
                    weights = torch.tensor(weight, dtype=total.dtype, device=total.device)
                    pair = self._reduce_tokens(torch.stack([total, weights]), "sum")
                    total, weight = (total, weight) if pair is None else (pair[0], pair[1])
                else:
                    reduced = self._reduce_tokens(total, e.reduce_fx)
                    total = total if reduced is None else reduced
                out[key] = float(total / weight) if e.reduce_fx == "mean" else float(total)
                e.total, e.weight = None, 0.0
            if key in out:
                e.epoch_value, e.epoch_stamp = out[key], self.boundary
        return out

    def logged_at(self, key: str) -> int | None:
        """The step boundary the latest value of ``key`` (as ``local_values`` names it) belongs to, or None."""
        for entries in self._entries.values():
            for name, e in entries.items():
                if e.epoch_value is not None and key == (f"{name}_epoch" if e.on_step else name):
                    return e.epoch_stamp
                if e.on_step and e.last is not None and key == name:
                    return e.stamp
        return None

    def local_values(self, prog_bar_only: bool) -> dict[str, float]:
        """Latest values on this rank (no communication): for progress bars and callbacks."""
        out = {}
        for entries in self._entries.values():
            for name, e in entries.items():
                if prog_bar_only and not e.prog_bar:
                    continue
                if e.on_step and e.last is not None:
                    out[name] = float(e.last)
                if e.epoch_value is not None:
                    out[f"{name}_epoch" if e.on_step else name] = e.epoch_value
        return out
