"""The ``pp`` axis of ``strategy="parallel"``: the model's ``pipeline_layers()`` cut into stages, one (or
``virtual_stages`` chunks) per rank of the ``pp`` group, the schedules of ``executor.py`` running between them.

Its part of each step: this rank sets up its stage alone (``local_module``), the gradient of a parameter tied across
stages is summed over them and counted on its first stage, the norm combines over the stages, checkpoints name the
stage's tensors by the whole model's names, and whole tensors are gathered from every stage.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.axis import Axis
from trainkit_strategies.base import Strategy
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.norms import combine_norm
from trainkit_strategies.pipeline.executor import Pipeline
from trainkit_strategies.state import pieces as st


class PipelineAxis(Axis):
    name = "pp"
    acts_on_gradients = True  # tied parameters' sums

    def __init__(self, comm: Comm, pipeline: Pipeline) -> None:
        super().__init__(comm)
        self.pipeline = pipeline

    @classmethod
    def of(cls, layout: Any) -> PipelineAxis | None:
        """For ``layout`` (a ``ParallelStrategy`` whose mesh is made), if it has stages: connected to its
        neighbours (collective)."""
        if layout.pipeline is None:
            return None
        layout.pipeline.connect(layout.comm, layout.mesh, layout.device)
        return cls(layout.comm, layout.pipeline)

    def local_module(self, module: nn.Module, optimizer: Optimizer | None, engine: Strategy,
                     whole_shape: Any, shapes: dict[str, tuple[int, ...]]) -> nn.Module:
        return self.pipeline.cut(module, optimizer, engine, whole_shape, shapes)

    def opened(self, module: nn.Module, engine: Strategy) -> None:
        engine._place(module)  # what no stage holds: metric states, say
        self.pipeline.open_channels()

    def reduce_gradients(self, engine: Strategy) -> None:
        self.pipeline.reduce_tied()

    def counted_elsewhere(self) -> list[Tensor]:
        return self.pipeline.counted_elsewhere()

    def combine_norm(self, norm: Tensor, norm_type: float) -> Tensor:
        return combine_norm(norm, norm_type, self.pipeline.pipe)

    def state(self, layout: st.StateLayout, group_names: list[list[str]]) -> st.StateLayout:
        return self.pipeline.renamed(layout, group_names)

    def whole(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.pipeline.gathered(tensors)

    def comms(self) -> list[Comm]:
        return [self.comm, *self.pipeline.own_comms()]

    def describe(self) -> str:
        return f"layers {self.pipeline.stage_sizes}"
