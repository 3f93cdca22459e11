"""Where a mixture-of-experts layer's tokens and experts live during a forward, set by the strategy around it.

``ExpertContext`` names the expert-parallel group (the ranks its experts are divided among, tokens sent to their
experts and back by all-to-all) and the sequence group (the ranks holding the other parts of the same sequences:
the context-parallel ones, and the tensor-parallel ones under sequence parallelism), over which the per-sequence
token counts of the load-balancing loss are summed. ``slices``: how many ranks compute one loss over the same
sequences while each sees a slice of them (tensor parallelism under sequence parallelism): their gradients are
summed, so each rank's auxiliary terms count its slice's share. Without a context (one process, or strategies with
no expert axis) a layer holds all its experts and its tokens are its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from trainkit_strategies.communication.comm import Comm


@dataclass(frozen=True)
class ExpertContext:
    ep: Comm | None = None  # the expert-parallel group (None: experts are all here)
    sequence: Comm | None = None  # ranks holding other tokens of the same sequences
    slices: int = 1  # ranks whose gradients sum to one sequence's (tp under sequence parallelism)


_local = threading.local()  # .context: this thread's (ranks as threads count apart)


def current() -> ExpertContext | None:
    return getattr(_local, "context", None)


@contextmanager
def expert_context(context: ExpertContext | None) -> Iterator[None]:
    """Run the enclosed forward (or backward, whose recomputed layers dispatch again) in ``context``."""
    previous = current()
    _local.context = context if context is not None else previous
    try:
        yield
    finally:
        _local.context = previous
