"""Optional abilities of a strategy (or of an optimizer under one), each a small interface of its own: callers ask
``capability(strategy, Capability)`` (the object that has it, or None), never for a concrete strategy class."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.communication.comm import Comm

if TYPE_CHECKING:
    from trainkit_strategies.base import Strategy

C = TypeVar("C")


def capability(strategy: Strategy, kind: type[C]) -> C | None:
    """The object that gives ``strategy`` the ability ``kind``: the strategy itself, a part it composes (a layout's
    pipeline), or None where it has not. A layout decides at construction what it can do, so a strategy need not be
    a subclass of every interface one of its layouts implements."""
    found = strategy.ability(kind)
    return found if isinstance(found, kind) else None


class SelfReducing(ABC):
    """An optimizer that, from some step on, averages across the data-parallel ranks itself (in compressed
    form), so the strategy leaves each rank's gradients local. Strategies that can run one set
    ``accepts_self_reducing`` and ``bind`` it to their communicator."""

    @abstractmethod
    def bind(self, comm: Comm) -> None: ...

    @property
    @abstractmethod
    def reduces_gradients(self) -> bool:
        """The next step averages across ranks itself: the strategy does not all-reduce its gradients."""

    @abstractmethod
    def local_state(self) -> dict[str, Tensor]:
        """Per-rank state (error feedback buffers) for checkpoints."""

    @abstractmethod
    def load_local_state(self, state: dict[str, Tensor]) -> None: ...

    def cached(self) -> list[Tensor]:
        """Tensors kept between steps that are neither state nor checkpointed (caches), for memory reports."""
        return []


def optimizer_extras(strategy: Strategy) -> list[Tensor]:
    """What an optimizer holds beyond ``optimizer.state``: compression's error feedback and its caches."""
    extras = list(strategy.local_state().values())
    if isinstance(strategy.optimizer, SelfReducing):
        extras += strategy.optimizer.cached()
    return extras


def check_optimizer(strategy: Strategy, optimizer: Optimizer | None) -> None:
    """Fail, naming the fix, when ``optimizer`` averages across ranks itself under a strategy that cannot run it."""
    if isinstance(optimizer, SelfReducing) and not strategy.accepts_self_reducing:
        raise ValueError(
            f"{type(optimizer).__name__} compresses the ranks' communication itself, which the {strategy.name!r} "
            "strategy does not support: run it under --trainer.strategy ddp, zero1 or zero2 (zero_offload only with "
            "offload false), or use torch.optim.AdamW with this strategy."
        )


class StepsInBackward(ABC):
    """The strategy can take the optimizer step during the window's last backward, bucket by bucket as each bucket's
    gradients are reduced (ZeRO-Offload's host step), when it knows the gradient multiplier before that backward and
    nothing needs the gradients before the step (no clipping by norm, no overflow check, no hook that reads them)."""

    @abstractmethod
    def step_in_backward(self, scale: float | Tensor) -> bool:
        """Called just before the window's last backward with the ``scale`` ``reduce_gradients`` will receive.
        Returns whether the step will run during that backward; ``reduce_gradients(scale)`` and ``optimizer_step()``
        are then called as usual and finish it (the gradients are spent by then)."""


class Parallelizes(ABC):
    """The strategy rewrites the model's layers for an axis of its layout (tensor parallelism) before any engine
    sees it: the first of the module transforms (then activation checkpointing, then compilation, then the
    data-parallel engine in ``setup``; torchtitan's ``parallelize_llama`` order)."""

    @abstractmethod
    def parallelize(self, module: nn.Module) -> None:
        """Transform ``module`` in place (parameter names unchanged)."""


class BuildsOnMeta(ABC):
    """The strategy builds the model on the meta device (``configure_model`` under ``init_context``) and, at setup,
    allocates only what this rank keeps, straight on its device, with the values a one-process run gives them
    (``trainkit_strategies/init``)."""

    @abstractmethod
    def init_context(self) -> contextlib.AbstractContextManager: ...


class ShardedInit(BuildsOnMeta):
    """The strategy builds on meta and materialises only this rank's shards of every parameter (ZeRO-3, FSDP)."""


class RunsSchedule(ABC):
    """The strategy runs forward and backward of a batch itself (pipeline schedules)."""

    @abstractmethod
    def run_schedule(self, module: nn.Module, batch: Any, weight: float) -> tuple[Tensor, Tensor | float]:
        """Forward and backward of ``batch``, each loss item weighted by ``weight``. Returns the batch's
        mean loss (on every rank) and the items this rank's losses counted (0 where no loss is computed)."""

    @abstractmethod
    def eval_schedule(self, module: nn.Module, batch: Any, batch_idx: int, fn: str = "validate") -> dict[str, Tensor]:
        """Forward-only evaluation of ``batch`` for ``fn`` ("validate" or "test"): metrics, identical on the
        ranks that run the schedule together."""

    @abstractmethod
    def evaluates(self, module: nn.Module, has_validation_step: bool) -> bool:
        """Whether validation runs for ``module`` under this schedule (``has_validation_step``: the module
        overrides ``validation_step``)."""

    @abstractmethod
    def crossing(self, module: nn.Module, batch: Any) -> dict[int, dict[tuple, tuple[tuple[int, ...], Any]]]:
        """For planning: the shape and dtype of what crosses each boundary of the schedule for ``batch``, traced on
        ``module`` (a whole copy of the model)."""

    @abstractmethod
    def expect(self, crossing: dict[int, dict[tuple, tuple[tuple[int, ...], Any]]]) -> None:
        """For planning a rank alone: take ``crossing`` as the shapes its peers would have announced."""
