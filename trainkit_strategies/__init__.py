"""trainkit's distributed strategies, on torch.distributed collectives. Never imports trainkit."""

from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import (
    BuildsOnMeta,
    Parallelizes,
    RunsSchedule,
    SelfReducing,
    ShardedInit,
    StepsInBackward,
    capability,
)
from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.data_parallel.single import SingleStrategy
from trainkit_strategies.planning.memory import ActivationMeter, MemoryReport
from trainkit_strategies.precision import DynamicLossScaler, Precision
from trainkit_strategies.registry import available, get_strategy, strategy_class

__all__ = [
    "ActivationMeter",
    "BuildsOnMeta",
    "DynamicLossScaler",
    "Environment",
    "MemoryReport",
    "Parallelizes",
    "Precision",
    "RunsSchedule",
    "SelfReducing",
    "ShardedInit",
    "SingleStrategy",
    "StepsInBackward",
    "Strategy",
    "available",
    "capability",
    "get_strategy",
    "strategy_class",
]
