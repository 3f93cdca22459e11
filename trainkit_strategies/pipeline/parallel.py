"""``strategy="parallel"`` with ``pp`` > 1: the pipeline's schedules between stages, and in each stage the
tensor- and data-parallel strategy of ``parallel.py`` on the stage's ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainkit_strategies.base import Strategy
from trainkit_strategies.layout import Layout
from trainkit_strategies.parallel import (
    AXES_USED,
    ParallelStrategy,
    check_degrees,
    resolve_layout,
    split_for_trace,
    unplanned,
)
from trainkit_strategies.pipeline.executor import PipelineStrategy
from trainkit_strategies.precision import Precision


class PipelinedParallel(PipelineStrategy):
    """What ``ParallelStrategy(pp=...)`` with ``pp`` > 1 builds (same arguments)."""

    name = "parallel"

    def __init__(self, tp: int = 1, dp_shard: int | None = None, dp_replicate: int = 1, pp: int = 2,
                 sequence_parallel: bool = True, microbatches: int = 4, schedule: str = "1f1b",
                 virtual_stages: int = 1, split: list[int] | None = None, reshard_after_forward: bool = True,
                 prefetch: bool = True, reduce_dtype: str | None = None, bucket_mb: float = 25.0,
                 tp_across_nodes: bool = False, cp: int = 1, cp_method: str = "ring") -> None:
        check_degrees(tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, pp=pp, cp=cp)
        if cp > 1:
            raise ValueError(f"parallel: cp={cp} with pp={pp} is not supported yet (context parallelism runs with "
                             "tp, dp_shard and dp_replicate): use pp=1, or cp=1.")
        sharded = dp_shard is None or dp_shard > 1
        super().__init__(stages=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                         split=split, data_parallel="fsdp" if sharded else "ddp", bucket_mb=bucket_mb)
        self.options: dict[str, Any] = dict(tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate,
                                            sequence_parallel=sequence_parallel,
                                            reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                                            reduce_dtype=reduce_dtype, bucket_mb=bucket_mb,
                                            tp_across_nodes=tp_across_nodes)
        self.tp, self.dp_shard, self.dp_replicate, self.pp = tp, dp_shard, dp_replicate, pp
        self.sequence_parallel = sequence_parallel and tp > 1

    def layout_for(self, world_size: int, ranks_per_node: int = 0) -> Layout:
        return resolve_layout(world_size, ranks_per_node, self.options["tp_across_nodes"], pp=self.pp, tp=self.tp,
                              dp_replicate=self.dp_replicate, dp_shard=self.dp_shard)

    def _layout(self, world_size: int) -> Layout:
        return self.layout_for(world_size, self.env.local_world_size)

    def _mesh_axes(self) -> list[tuple[str, ...]]:
        return [*super()._mesh_axes(), *AXES_USED]

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        self.inner.named_by = module  # type: ignore[attr-defined]  # the plan names the module's submodules
        super().setup(module, optimizer, precision)

    def unfit_for(self, module: nn.Module, optimizer: Optimizer | None) -> str | None:
        return unplanned(module, self.tp) or super().unfit_for(module, optimizer)

    def describe(self) -> str:
        return f"{self.layout}, layers {self.stage_sizes}"

    def activation_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return split_for_trace(model, self.tp, self.sequence_parallel, device)

    def _make_inner(self) -> Strategy:
        inner = ParallelStrategy(pp=1, **{k: v for k, v in self.options.items()
                                          if k not in ("prefetch",)},
                                 prefetch=self.options["prefetch"] and self.virtual_stages == 1)
        inner.mesh = self.mesh  # the stage's groups are the pipeline's mesh's: made once, by every rank
        return inner
