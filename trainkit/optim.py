"""What configure_optimizers may return, normalised to one optimizer and an optional scheduler; and trainkit's own
optimizers (``OneBitAdam``: 1-bit Adam with compressed communication, for the ddp strategy)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from trainkit_strategies.data_parallel.onebit import OneBitAdam

__all__ = ["OneBitAdam", "OptimizerConfig", "parse_optimizers", "warmup_cosine"]


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, max_steps: int, floor: float = 0.1) -> LambdaLR:
    """The learning rate rising linearly over ``warmup_steps``, then falling along a cosine to ``floor`` of its peak at
    ``max_steps`` (GPT-style; a scheduler to step every optimizer step: ``"interval": "step"``)."""
    total = max(max_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


@dataclass
class OptimizerConfig:
    """Attributes:
        optimizer: the user's optimizer (strategies re-target it in place).
        scheduler: an LR scheduler over it, or None.
        interval: "step" (after every optimizer step) or "epoch".
        frequency: step the scheduler every this many intervals.
        monitor: metric name for ReduceLROnPlateau.
    """

    optimizer: Optimizer
    scheduler: LRScheduler | ReduceLROnPlateau | None = None
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None


def _scheduler(spec: Any) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        if "scheduler" not in spec:
            raise ValueError("An lr_scheduler dict needs a 'scheduler' key.")
        return dict(spec)
    return {"scheduler": spec}


def parse_optimizers(value: Any) -> OptimizerConfig:
    """Accepts ``opt``, ``[opt]``, ``(opt, sched)``, ``([opt], [sched])`` or ``{"optimizer", "lr_scheduler"}``."""
    sched_spec: dict[str, Any] | None = None
    if isinstance(value, Sequence) and len(value) == 1 and isinstance(value[0], Optimizer):
        value = value[0]  # [optimizer]
    if isinstance(value, Optimizer):
        optimizer = value
    elif isinstance(value, Mapping):
        optimizer = value.get("optimizer")
        if value.get("lr_scheduler") is not None:
            sched_spec = _scheduler(value["lr_scheduler"])
    elif isinstance(value, Sequence) and len(value) == 2:
        opts, scheds = value
        opts = list(opts) if isinstance(opts, Sequence) else [opts]
        scheds = list(scheds) if isinstance(scheds, Sequence) else [scheds]
        if len(opts) != 1 or len(scheds) > 1:
            raise ValueError("trainkit trains with one optimizer and at most one LR scheduler.")
        optimizer = opts[0]
        sched_spec = _scheduler(scheds[0]) if scheds else None
    else:
        raise ValueError(
            "configure_optimizers must return an optimizer, (optimizer, scheduler), or "
            f"{{'optimizer': ..., 'lr_scheduler': ...}}; got {type(value).__name__}."
        )
    if not isinstance(optimizer, Optimizer):
        raise ValueError(f"configure_optimizers returned {type(optimizer).__name__} where an Optimizer belongs.")
    config = OptimizerConfig(optimizer)
    if sched_spec is not None:
        config.scheduler = sched_spec["scheduler"]
        config.interval = sched_spec.get("interval", "epoch")
        config.frequency = int(sched_spec.get("frequency", 1))
        config.monitor = sched_spec.get("monitor")
        if config.interval not in ("step", "epoch"):
            raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch'; got {config.interval!r}.")
        if config.frequency < 1:
            raise ValueError(f"lr_scheduler frequency must be >= 1; got {config.frequency}.")
        if getattr(config.scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("The LR scheduler wraps a different optimizer than the one returned.")
        if isinstance(config.scheduler, ReduceLROnPlateau) and config.monitor is None:
            raise ValueError("ReduceLROnPlateau needs 'monitor' in the lr_scheduler dict (a logged metric name).")
    return config
