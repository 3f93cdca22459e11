"""``strategy="pipeline"``: a preset of the composed layout (``parallel/strategy.py``) with stages and one
data-parallel axis.

``--trainer.strategy pipeline --trainer.strategy.data_parallel zero2`` is ``ParallelStrategy`` on the layout
``pp=stages x dp_shard=world/stages`` with the ``zero2`` engine in every stage (``ddp`` replicates a stage over
``dp_replicate``); its options are the pipeline's.
"""

from __future__ import annotations

import copy

from torch import nn

from trainkit_strategies.base import Strategy
from trainkit_strategies.communication.layout import Layout
from trainkit_strategies.parallel.strategy import ParallelStrategy
from trainkit_strategies.pipeline.executor import DATA_PARALLEL, Pipeline, check_schedule
from trainkit_strategies.registry import strategy_class


class PipelineStrategy(ParallelStrategy):
    """Split the model's layers into stages across ranks and pipeline micro-batches through them.

    Args:
        stages: pipeline depth (default: every rank a stage). The world size must be a multiple of it.
        microbatches: pieces each batch is cut into along its first dimension (``tensor_split``: sizes
            differ by at most one); a batch with fewer samples runs with one micro-batch per sample.
        schedule: "1f1b" (bounded activation memory), "gpipe", "interleaved_1f1b" (with ``virtual_stages``;
            ``microbatches`` a multiple of ``stages``) or "zero_bubble" (ZB-H1: B and W split).
        virtual_stages: model chunks per rank under "interleaved_1f1b" (or "gpipe").
        split: layers per chunk (``stages * virtual_stages`` of them), e.g. ``[3, 5]``; default: balanced by
            parameter count.
        data_parallel: strategy reducing each stage's gradients across replicas: "ddp", "zero1", "zero2" or
            "fsdp".
        bucket_mb: bucket size of that strategy (ddp and ZeRO).
        measure_activations: record the peak of activation bytes alive per step (``pipeline.activation_peak``).
    """

    name = "pipeline"

    def __init__(self, stages: int | None = None, microbatches: int = 4, schedule: str = "1f1b",
                 virtual_stages: int = 1, split: list[int] | None = None, data_parallel: str = "ddp",
                 bucket_mb: float = 25.0, measure_activations: bool = False) -> None:
        if stages is not None and stages < 1:
            raise ValueError(f"pipeline stages must be >= 1; got {stages}.")
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"pipeline data_parallel must be one of {', '.join(DATA_PARALLEL)}; "
                             f"got {data_parallel!r}.")
        super().__init__(bucket_mb=bucket_mb, data_parallel=data_parallel)
        self.pipeline = Pipeline(microbatches, schedule, virtual_stages, split, measure_activations)
        check_schedule(schedule, data_parallel)
        self.stages = stages

    def layout_for(self, world_size: int, ranks_per_node: int = 0) -> Layout:
        """Stages x replicas, stages outermost: ddp replicates a stage, the ZeRO stages and fsdp shard it."""
        stages = self.stages or world_size
        if world_size % stages:
            raise ValueError(f"pipeline: world_size={world_size} is not a multiple of stages={stages}; "
                             f"use a world size of stages x replicas.")
        return Layout(pp=stages, **{strategy_class(self.data_parallel).data_axis: world_size // stages})

    def planned(self, module: nn.Module, world_size: int) -> tuple[Strategy, list[int]]:
        """Stages left open: as many as the world and the layers allow. The first rank of every stage is planned."""
        planned = copy.deepcopy(self)
        assert planned.pipeline is not None
        planned.stages = planned.stages or planned.pipeline.stages_for(module, world_size)
        replicas = world_size // planned.stages
        return planned, [stage * replicas for stage in range(planned.stages)]

    def describe(self) -> str:
        assert self.pipeline is not None
        return (f"{self.pipeline.stages} stages x {self.pipeline.on_stage.world_size} replicas, "
                f"layers {self.pipeline.stage_sizes}")
