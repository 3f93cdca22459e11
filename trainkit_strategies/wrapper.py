"""One way to compose strategies: a ``Wrapper`` runs an inner strategy on what it hands it.

The composed layout (``parallel/strategy.py``) hands the tensor-parallel model, or a pipeline stage of it, to the
data-parallel engine of the ranks holding the same slices (one level: the engine is never a wrapper). The wrapper
changes what its axes change (cutting the model, the point-to-point traffic, norms combined across stages or
slices, names in checkpoints) and every other part of the contract is the inner strategy's, here, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any

from torch import Tensor

from trainkit_strategies.base import Strategy
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import groups_fixed
from trainkit_strategies.planning.memory import MemoryReport
from trainkit_strategies.state import pieces as st


class Wrapper(Strategy):
    """A strategy whose work is done by ``self.inner`` (made in ``setup_environment``) except where it overrides."""

    inner: Strategy
    accepts_new_groups = False  # see refresh_groups
    any_reduce_dtype = True  # the inner engine reduces the gradients, and refuses a reduce_dtype it cannot keep

    @property
    def dp_rank(self) -> int:
        return self.inner.dp_rank

    @property
    def dp_size(self) -> int:
        return self.inner.dp_size

    def local_batch(self, batch: Any) -> Any:
        return self.inner.local_batch(batch)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.inner.forward_context()

    def backward(self, loss: Tensor, gradient: Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False) -> None:
        self.inner.backward(loss, gradient, retain_graph, create_graph)

    def backward_pass(self) -> contextlib.AbstractContextManager:
        return self.inner.backward_pass()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.inner.no_sync()

    def reduce_gradients(self, scale: float | Tensor) -> None:
        self.inner.reduce_gradients(scale)

    def gradients(self) -> list[Tensor]:
        return self.inner.gradients()

    def keep_apart(self, params: Collection[Tensor]) -> None:
        self.inner.keep_apart(params)

    def gradients_of(self, params: Collection[Tensor]) -> list[Tensor]:
        return self.inner.gradients_of(params)

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        return self.inner.grad_norm(norm_type, exclude)

    def scale_grads(self, factor: float | Tensor) -> None:
        self.inner.scale_grads(factor)

    def clip_grad_value(self, value: float) -> None:
        self.inner.clip_grad_value(value)

    def full_parameters(self) -> dict[str, Tensor]:
        return self.inner.full_parameters()

    def full_gradients(self) -> dict[str, Tensor]:
        return self.inner.full_gradients()

    def optimizer_step(self) -> None:
        if self._groups_changed():
            self.refresh_groups()
        self.inner.optimizer_step()

    def refresh_groups(self) -> None:
        """Refused: the layout cut and renamed the model, and its engine planned, by the groups it was set up with."""
        raise groups_fixed(self.name, "the optimizer has a param group it was not set up with (added with "
                                      "optimizer.add_param_group)")

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def settle(self) -> None:
        self.inner.settle()

    def sync_buffers(self) -> None:
        self.inner.sync_buffers()

    def own_comms(self) -> list[Comm]:
        """The communicators this wrapper moves data through itself (beside ``self.comm``)."""
        return []

    def comms(self) -> list[Comm]:
        unique = {id(c): c for c in [self.comm, *self.own_comms(), *self.inner.comms()]}
        return list(unique.values())

    def state_layout(self) -> st.StateLayout:
        return self.inner.state_layout()

    def local_state(self) -> dict[str, Tensor]:
        return self.inner.local_state()

    def load_local_state(self, state: dict[str, Tensor]) -> None:
        self.inner.load_local_state(state)

    def _after_load(self) -> None:
        self.inner._after_load()

    def memory_report(self) -> MemoryReport:
        return self.inner.memory_report()

    def teardown(self) -> None:
        self.inner.teardown()

    def trainable(self) -> list[Any]:
        return self.inner.trainable()
