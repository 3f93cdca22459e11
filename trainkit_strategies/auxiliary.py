"""Auxiliary losses: terms a layer adds to the training objective from inside the forward (a mixture of experts'
load-balancing and router z-losses), which the step adds to the module's loss before its backward.

A layer calls ``add_auxiliary_loss(t)`` while the step collects (``collecting()``: around ``training_step``, and
around each pipeline stage's forward); the step's backward then runs on ``loss + sum(collected)``, weighted as the
loss is (items, accumulation, loss scaling), so a term that is a mean over a rank's tokens combines across ranks and
micro-batches as the loss does. Outside a collecting step (validation, a plain forward) nothing is kept. The logged
loss is the module's own; the layers report their terms themselves (``trainkit.moe.moe_metrics``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

_local = threading.local()  # .stack: the lists of the collecting contexts this thread is inside (ranks as threads)


@contextmanager
def collecting() -> Iterator[list[Tensor]]:
    """Collect the auxiliary losses added while inside; yields the list they are appended to."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    found: list[Tensor] = []
    stack.append(found)
    try:
        yield found
    finally:
        stack.pop()


def add_auxiliary_loss(term: Tensor) -> None:
    """Add ``term`` (a scalar in the autograd graph) to the objective of the step collecting, if any."""
    stack = getattr(_local, "stack", None)
    if stack and term.requires_grad:
        stack[-1].append(term)


def with_auxiliary(loss: Tensor, found: list[Tensor]) -> Tensor:
    """``loss`` plus the terms collected for it."""
    for term in found:
        loss = loss + term.to(loss.dtype)
    return loss
