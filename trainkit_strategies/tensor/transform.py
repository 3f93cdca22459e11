"""The ``tp`` axis of ``strategy="parallel"``: every layer the module's ``tensor_parallel_plan()`` names cut to this
rank's part (Megatron-LM), and, under sequence parallelism, the regions between them working on a slice of the
sequence (Korthikanti et al., 2022). The parameters the plan leaves whole see a slice of the sequence each on
every rank, so their gradients are summed across the group (``Dividing``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from trainkit_strategies.axis import Dividing
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.tensor.huggingface import indivisible_heads
from trainkit_strategies.tensor.plan import Applied, apply_plan
from trainkit_strategies.tensor.planned import plan_for, same_start


class TensorParallel(Dividing):
    name = "tp"

    def __init__(self, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__(comm, sums=sequence_parallel)  # without it every rank saw the whole sequence
        self.sequence_parallel = sequence_parallel
        self.applied = Applied()

    @classmethod
    def of(cls, layout: Any) -> TensorParallel | None:
        """For ``layout`` (a ``ParallelStrategy`` whose mesh is made), if it has ``tp`` > 1."""
        return cls(layout.tp_comm, layout.sequence_parallel) if layout.tp > 1 else None

    def transform(self, module: nn.Module, device: Any) -> None:
        """Every planned layer cut to this rank's part, from tensor-parallel rank 0's values."""
        tp = self.comm.world_size
        plan = plan_for(module)
        if plan is None:
            raise TypeError(
                f"Strategy 'parallel' with tp={tp} needs {type(module).__name__} to define "
                "tensor_parallel_plan() -> {submodule pattern: style} (which layers are split, and how), or to "
                "hold a Hugging Face model that declares one; see docs/parallel.md, or run with tp=1."
            )
        heads = indivisible_heads(module, tp)
        if heads is not None:
            raise ConfigurationError(f"Strategy 'parallel' with tp={tp}: {heads}")
        same_start(module, self.comm, device)
        self.applied = apply_plan(module, plan, self.comm, self.sequence_parallel)
        self.splits = dict(self.applied.splits)

    def describe(self) -> str:
        return "" if self.sequence_parallel else "no sequence parallelism"
