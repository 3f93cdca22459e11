"""What a composing strategy asks of the strategy it composes about gradients (a part of every ``Strategy``): the
gradient tensors, those of some parameters kept apart, scaling them, the autograd pass around a backward."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

import torch
from torch import Tensor, nn


class GradientParts:
    """The gradients a rank holds, for a strategy composing this one (the layout in ``parallel/strategy.py``) and for
    clipping: ``gradients``, ``keep_apart``/``gradients_of``, ``scale_grads``, ``backward_pass``, ``trainable``."""

    module: nn.Module | None

    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        """Around one autograd pass that accumulates parameter gradients: a backward, or the weight-gradient
        pass of a zero-bubble pipeline schedule. Strategies whose gradient hooks count what each pass brings
        reset the count here."""
        yield

    def gradients(self) -> list[Tensor]:
        """The gradient tensors this rank holds (whole or shards), for norms and scaling."""
        assert self.module is not None
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def keep_apart(self, params: Collection[Tensor]) -> None:
        """Hold the gradients of ``params`` apart from the others' (called before ``setup``), so that a strategy
        composing this one can name them: ``gradients_of(params)`` (to sum them across the ranks that share the
        parameters: tensor-parallel replicas, stages tied by a shared weight) and ``grad_norm(exclude=params)`` (to
        count them once). Strategies holding whole gradients hold each apart already."""

    def gradients_of(self, params: Collection[Tensor]) -> list[Tensor]:
        """The gradient tensors this rank holds for exactly ``params`` (whole, or the shards ``keep_apart`` set up)."""
        return [p.grad for p in params if p.grad is not None]

    def _counted(self, exclude: Collection[Tensor]) -> list[Tensor]:
        if not exclude:
            return self.gradients()
        assert self.module is not None
        skip = {id(p) for p in exclude}
        return [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]

    def scale_grads(self, factor: float | Tensor) -> None:
        self._scale_local_grads(factor)

    def _scale_local_grads(self, factor: float | Tensor) -> None:
        if isinstance(factor, float | int) and factor == 1.0:
            return
        grads = self.gradients()
        if not grads:
            return
        if isinstance(factor, Tensor):
            factor = factor.to(grads[0].device)
        torch._foreach_mul_(grads, factor)

    def trainable(self) -> list[Tensor]:
        """The parameters this rank computes gradients for (a pipeline stage's, say)."""
        assert self.module is not None
        return [p for p in self.module.parameters() if p.requires_grad]
