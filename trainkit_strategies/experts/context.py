"""Where a mixture-of-experts layer's tokens and experts live, installed on the layer by the ``ep`` axis's transform
(``transform.py``) as its ``expert_context``.

``ExpertContext`` names the expert-parallel group (the ranks its experts are divided among, tokens sent to their
experts and back by all-to-all) and the sequence group (the ranks holding the other parts of the same sequences:
the context-parallel ones, and the tensor-parallel ones under sequence parallelism), over which the per-sequence
token counts of the load-balancing loss are summed. ``slices``: how many ranks compute one loss over the same
sequences while each sees a slice of them (tensor parallelism under sequence parallelism): their gradients are
summed, so each rank's auxiliary terms count its slice's share. A layer no strategy transformed (one process, or
strategies with no expert axis) has the default: all its experts are here and its tokens are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainkit_strategies.communication.comm import Comm


@dataclass(frozen=True)
class ExpertContext:
    ep: Comm | None = None  # the expert-parallel group (None: experts are all here)
    sequence: Comm | None = None  # ranks holding other tokens of the same sequences
    slices: int = 1  # ranks whose gradients sum to one sequence's (tp under sequence parallelism)

    def __deepcopy__(self, memo: dict) -> ExpertContext:
        """A copy of the model (``copy.deepcopy``) runs on its own: a communicator holds a process group, which
        cannot be copied."""
        return ExpertContext()
