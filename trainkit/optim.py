"""What configure_optimizers may return, normalised to the run's optimizers and LR schedulers; and trainkit's own
optimizers (``OneBitAdam``: 1-bit Adam with compressed communication, for the ddp strategy)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from trainkit.errors import ConfigurationError
from trainkit_strategies.data_parallel.onebit import OneBitAdam

__all__ = ["OneBitAdam", "OptimizerConfig", "SchedulerConfig", "parse_optimizers", "warmup_cosine"]

ACCEPTED = (
    "configure_optimizers may return: an optimizer; a list or tuple of optimizers; (optimizer, scheduler); "
    "([optimizers], [schedulers]) where a scheduler may be a dict {'scheduler': s, 'interval': 'step' | 'epoch', "
    "'frequency': n, 'monitor': name}; a dict {'optimizer': opt, 'lr_scheduler': scheduler or dict, 'monitor': name}; "
    "or a list or tuple of such dicts"
)


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
class SchedulerConfig:
    """Attributes:
        scheduler: an LR scheduler over one of the run's optimizers.
        interval: "step" (after every optimizer step) or "epoch".
        frequency: step the scheduler every this many intervals.
        monitor: metric name for ReduceLROnPlateau.
    """

    scheduler: LRScheduler | ReduceLROnPlateau
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None


@dataclass
class OptimizerConfig:
    """The optimizers and LR schedulers ``configure_optimizers`` returned.

    Attributes:
        optimizers: the user's optimizers, in the order returned (strategies re-target them in place).
        schedulers: their LR schedulers, in the order returned.
    """

    optimizers: list[Optimizer]
    schedulers: list[SchedulerConfig] = field(default_factory=list)

    @property
    def optimizer(self) -> Optimizer:
        """The first optimizer (the only one under automatic optimization)."""
        return self.optimizers[0]

    @property
    def scheduler(self) -> LRScheduler | ReduceLROnPlateau | None:
        """The first scheduler, or None."""
        return self.schedulers[0].scheduler if self.schedulers else None

    def state_dict(self) -> Any:
        """The schedulers' states: one scheduler's own (the format of every earlier checkpoint), or a list."""
        states = [s.scheduler.state_dict() for s in self.schedulers]
        return states[0] if len(states) == 1 else {"schedulers": states}

    def load_state_dict(self, state: Any) -> None:
        states = state["schedulers"] if isinstance(state, Mapping) and "schedulers" in state else [state]
        if len(states) != len(self.schedulers):
            raise ConfigurationError(f"The checkpoint holds {len(states)} LR scheduler state(s) and "
                                     f"configure_optimizers returned {len(self.schedulers)} scheduler(s).")
        for config, saved in zip(self.schedulers, states, strict=True):
            config.scheduler.load_state_dict(saved)


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, Optimizer)


def _scheduler(spec: Any, monitor: str | None = None) -> SchedulerConfig:
    spec = dict(spec) if isinstance(spec, Mapping) else {"scheduler": spec}
    if "scheduler" not in spec:
        raise ConfigurationError(f"An lr_scheduler dict needs a 'scheduler' key; got keys {sorted(spec)}.")
    config = SchedulerConfig(spec["scheduler"], spec.get("interval", "epoch"), int(spec.get("frequency", 1)),
                             spec.get("monitor", monitor))
    if not isinstance(config.scheduler, LRScheduler | ReduceLROnPlateau):
        raise ConfigurationError(f"{type(config.scheduler).__name__} stands where an LR scheduler belongs. {ACCEPTED}.")
    if config.interval not in ("step", "epoch"):
        raise ConfigurationError(f"lr_scheduler interval must be 'step' or 'epoch'; got {config.interval!r}.")
    if config.frequency < 1:
        raise ConfigurationError(f"lr_scheduler frequency must be >= 1; got {config.frequency}.")
    if isinstance(config.scheduler, ReduceLROnPlateau) and config.monitor is None:
        raise ConfigurationError("ReduceLROnPlateau needs 'monitor' in the lr_scheduler dict (a logged metric name).")
    return config


def _dict_entry(value: Mapping) -> tuple[Optimizer, list[SchedulerConfig]]:
    unknown = sorted(set(value) - {"optimizer", "lr_scheduler", "monitor"})
    if unknown:
        rank_zero_warn(f"configure_optimizers returned a dict with keys {unknown}, which trainkit (like Lightning 2.x) "
                       "does not use: only 'optimizer', 'lr_scheduler' and 'monitor' are read.")
    optimizer = value.get("optimizer")
    if not _is_optimizer(optimizer):
        raise ConfigurationError(f"The dict from configure_optimizers has {type(optimizer).__name__} under "
                                 f"'optimizer'. {ACCEPTED}.")
    spec = value.get("lr_scheduler")
    return optimizer, [] if spec is None else [_scheduler(spec, value.get("monitor"))]


def parse_optimizers(value: Any) -> OptimizerConfig:
    """Read every form Lightning's ``configure_optimizers`` accepts (``ACCEPTED``), and ``(optimizer, scheduler)``;
    anything else is a ConfigurationError listing them. A scheduler must drive one of the returned optimizers, and
    a parameter may be trained by one optimizer only."""
    optimizers: list[Optimizer]
    schedulers: list[SchedulerConfig] = []
    items = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if _is_optimizer(value):
        optimizers = [value]
    elif isinstance(value, Mapping):
        optimizer, schedulers = _dict_entry(value)
        optimizers = [optimizer]
    elif items and all(_is_optimizer(v) for v in items):
        optimizers = items
    elif items and all(isinstance(v, Mapping) for v in items):
        optimizers = []
        for entry in items:
            optimizer, scheds = _dict_entry(entry)
            optimizers.append(optimizer)
            schedulers += scheds
    elif items and len(items) == 2 and _is_optimizer(items[0]):  # (optimizer, scheduler)
        optimizers, schedulers = [items[0]], [_scheduler(items[1])]
    elif items and len(items) == 2 and isinstance(items[0], Sequence) and isinstance(items[1], Sequence | Mapping) \
            and items[0] and all(_is_optimizer(v) for v in items[0]):  # ([optimizers], [schedulers])
        optimizers = list(items[0])
        specs = [items[1]] if isinstance(items[1], Mapping) else list(items[1])
        schedulers = [_scheduler(s) for s in specs]
    else:
        raise ConfigurationError(f"configure_optimizers returned {_describe(value)}, which trainkit cannot read. "
                                 f"{ACCEPTED}.")
    _check(optimizers, schedulers)
    return OptimizerConfig(optimizers, schedulers)


def _describe(value: Any) -> str:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _check(optimizers: list[Optimizer], schedulers: list[SchedulerConfig]) -> None:
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ConfigurationError(
                f"{type(optimizer).__name__}.step needs a closure that it calls again and again (a line search), "
                "which trainkit's strategies do not run: they reduce the gradients once before the step. Use an "
                "optimizer that steps on the gradients it is given (SGD, Adam, AdamW, ...).")
        for group in optimizer.param_groups:
            for param in group["params"]:
                if owner.setdefault(id(param), index) != index:
                    raise ConfigurationError(
                        f"A parameter of shape {tuple(param.shape)} is in optimizers {owner[id(param)]} and {index}; "
                        "each parameter may be trained by one optimizer only.")
    for config in schedulers:
        target = getattr(config.scheduler, "optimizer", None)
        if not any(target is o for o in optimizers):
            raise ConfigurationError(f"The LR scheduler {type(config.scheduler).__name__} drives an optimizer that "
                                     "configure_optimizers did not return.")
