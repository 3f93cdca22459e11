"""Strategy names -> classes. Third-party strategies register through the entry-point group
``trainkit.strategies`` (``name = "package.module:Class"``)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from trainkit_strategies.base import Strategy
from trainkit_strategies.errors import ConfigurationError

_BUILTIN = {
    "single": "trainkit_strategies.data_parallel.single:SingleStrategy",
    "ddp": "trainkit_strategies.data_parallel.ddp:DDPStrategy",
    "zero1": "trainkit_strategies.data_parallel.zero:Zero1Strategy",
    "zero2": "trainkit_strategies.data_parallel.zero:Zero2Strategy",
    "zero_offload": "trainkit_strategies.data_parallel.offload:ZeroOffloadStrategy",
    "zero3": "trainkit_strategies.sharding.zero3:Zero3Strategy",
    "fsdp": "trainkit_strategies.sharding.fsdp:FSDPStrategy",
    "pipeline": "trainkit_strategies.parallel.pipeline:PipelineStrategy",
    "parallel": "trainkit_strategies.parallel.strategy:ParallelStrategy",
}
MOVED = {  # options strategies took once, and where they are set now (an old config is told, not just refused)
    "reduce_dtype": "reduce_dtype is no longer a strategy option: it is the precision policy's, one setting for every "
                    "strategy. Set it on the Trainer: --trainer.reduce_dtype fp32 on the command line, `reduce_dtype: "
                    "fp32` under `trainer:` in a config file, Trainer(reduce_dtype=\"fp32\") in Python (driving a "
                    "strategy by hand: Precision.from_name(precision, reduce_dtype=\"fp32\") passed to setup).",
}


def _load(target: str) -> type[Strategy]:
    module_name, _, attr = target.partition(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


def available() -> dict[str, str]:
    """Every known name with its ``module:Class`` target; built-ins win over plugins of the same name."""
    found = {ep.name: ep.value for ep in entry_points(group="trainkit.strategies")}
    return found | _BUILTIN


def strategy_class(name: str) -> type[Strategy]:
    targets = available()
    if name not in targets:
        raise ValueError(f"Unknown strategy {name!r}. Valid strategies: {', '.join(sorted(targets))}.")
    cls = _load(targets[name])
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"Strategy {name!r} resolves to {targets[name]}, which is not a Strategy subclass.")
    return cls


def get_strategy(name: str, **options: Any) -> Strategy:
    """Build the strategy registered as ``name`` with its constructor options."""
    moved = [MOVED[option] for option in options if option in MOVED]
    if moved:
        raise ConfigurationError(moved[0])
    return strategy_class(name)(**options)
