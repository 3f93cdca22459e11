"""``strategy="parallel"``: data, tensor (and sequence) and pipeline parallelism at once, on one layout of the ranks.

The world is the grid ``pp x dp_replicate x dp_shard x cp x tp`` (``layout.py``). A rank holds:

- with ``tp`` > 1, its slice of every layer the module's ``tensor_parallel_plan()`` names (Megatron-LM; under
  ``sequence_parallel`` the norms, dropouts and residuals between those layers work on its slice of the sequence:
  Korthikanti et al., 2022);
- with ``dp_shard`` > 1, 1/dp_shard of that slice (the FSDP engine over the ``dp_shard`` group, units as ``fsdp``
  chooses them); with ``dp_replicate`` > 1 as well, the shards are replicated and their gradients all-reduced
  across replicas once per step (HSDP); with only ``dp_replicate``, ``ddp`` among the replicas;
- with ``pp`` > 1, one stage's layers (``pipeline_layers()``), the pipeline's schedules running between stages and
  all of the above inside each stage (``PipelinedParallel``);
- with ``cp`` > 1, two of ``2 x cp`` chunks of every sequence (``local_batch``), attention running across the
  context-parallel group (``context/ring.py``) and parameters sharded over ``dp_shard x cp``.

Gradients of parameters the plan leaves whole are summed across the tensor-parallel group under sequence
parallelism (each rank saw a slice of the sequence) and counted once in norms; the batch is read once per
data-parallel coordinate, by all the tensor-parallel ranks of it; checkpoints hold each parameter's part as a
strided piece, so they resume under any strategy and layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterator
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import Parallelizes
from trainkit_strategies.comm import Comm
from trainkit_strategies.context.ring import METHODS, ContextParallel, context_parallel, shard_sequence
from trainkit_strategies.environment import Environment
from trainkit_strategies.layout import Layout, Mesh
from trainkit_strategies.norms import combine_norm
from trainkit_strategies.pipeline.executor import PipelineStrategy
from trainkit_strategies.plan_comm import PlanComm
from trainkit_strategies.precision import Precision, dtype_named
from trainkit_strategies.registry import get_strategy
from trainkit_strategies.tensor.plan import Applied, apply_plan
from trainkit_strategies.wrapper import Wrapper

AXES_USED = [("tp",), ("dp_shard", "cp"), ("dp_replicate",), ("dp_replicate", "dp_shard", "cp")]


class ParallelStrategy(Wrapper, Parallelizes):
    """Several parallelisms at once. From the command line: ``--trainer.strategy parallel --trainer.strategy.tp 2
    --trainer.strategy.dp_shard 2``.

    Args:
        tp: tensor-parallel degree: each planned layer split over this many ranks (consecutive ranks: keep them on
            one node). The module must define ``tensor_parallel_plan()``.
        dp_shard: ranks each replica's parameters, gradients and optimizer state are sharded over (FSDP units).
            Default: what the world leaves (world / (tp x pp x cp x dp_replicate)).
        dp_replicate: replicas; with ``dp_shard`` > 1 this is HSDP, alone it is ddp.
        pp: pipeline stages (the module must define ``pipeline_layers()`` and ``pipeline_loss()``).
        cp: context parallelism: each rank of a ``cp`` group holds 2 of ``2 x cp`` chunks of every sequence (dimension
            1 of every batch tensor of 2 or more dimensions) and attention runs across the group; the module's
            attention must call ``trainkit.parallel.attention`` and its positions come from
            ``trainkit.parallel.positions``. Parameters are sharded over ``dp_shard x cp`` (their gradients are
            sums over the sequence's chunks).
        cp_method: how keys and values reach the other ranks: "ring" (passed around, one block at a time,
            overlapped with attention) or "all_gather" (gathered whole once per layer, as Llama 3 does).
        sequence_parallel: under tp, shard the regions between tensor-parallel layers along the sequence too (the
            activations of norms, dropouts and residuals divided by tp; the same bytes communicated).
        microbatches, schedule, virtual_stages, split: the pipeline's, as for ``strategy="pipeline"``.
        reshard_after_forward, prefetch, reduce_dtype: the sharding engine's, as for ``fsdp``.
        bucket_mb: ddp's bucket size (``dp_replicate`` alone).
        tp_across_nodes: allow a tensor-parallel group to span nodes (its all-reduces then cross the network).
    """

    name = "parallel"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        pp = kwargs.get("pp", args[3] if len(args) > 3 else 1)
        if cls is ParallelStrategy and isinstance(pp, int) and pp > 1:
            return PipelinedParallel(*args, **kwargs)  # not a ParallelStrategy: this __init__ does not run again
        return super().__new__(cls)

    def __init__(self, tp: int = 1, dp_shard: int | None = None, dp_replicate: int = 1, pp: int = 1,
                 sequence_parallel: bool = True, microbatches: int = 4, schedule: str = "1f1b",
                 virtual_stages: int = 1, split: list[int] | None = None, reshard_after_forward: bool = True,
                 prefetch: bool = True, reduce_dtype: str | None = None, bucket_mb: float = 25.0,
                 tp_across_nodes: bool = False, cp: int = 1, cp_method: str = "ring") -> None:
        super().__init__()
        check_degrees(tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, pp=pp, cp=cp)
        if cp_method not in METHODS:
            raise ValueError(f"parallel cp_method must be one of {METHODS}; got {cp_method!r}.")
        dtype_named(reduce_dtype, "parallel reduce_dtype")  # checked here; the sharding engine uses it
        self.tp, self.dp_shard, self.dp_replicate, self.pp = tp, dp_shard, dp_replicate, pp
        self.cp, self.cp_method = cp, cp_method
        self._cp: ContextParallel | None = None
        self.sequence_parallel = sequence_parallel and tp > 1
        self.reshard_after_forward, self.prefetch, self.reduce_dtype = reshard_after_forward, prefetch, reduce_dtype
        self.bucket_mb, self.tp_across_nodes = bucket_mb, tp_across_nodes
        self.mesh: Mesh | None = None  # set by a composing pipeline before setup_environment (its stages' groups)
        self.inner: Strategy = get_strategy("single")
        self.applied = Applied()
        self._replicated: list[Tensor] = []
        self._strided: dict[str, st.Strided] = {}
        self._whole_shapes: dict[str, tuple[int, ...]] = {}
        self._whole_shape: dict[Tensor, tuple[int, ...]] = {}  # by parameter, as parallelize found them
        self._parallelized = False

    # -- layout --------------------------------------------------------------------------------------
    def layout_for(self, world_size: int, ranks_per_node: int = 0) -> Layout:
        """The layout at ``world_size`` ranks (``dp_shard`` defaulting to what the others leave), checked."""
        return resolve_layout(world_size, ranks_per_node, self.tp_across_nodes, pp=self.pp, tp=self.tp,
                              dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp)

    def setup_environment(self, env: Environment, comm: Comm | None = None) -> None:
        Strategy.setup_environment(self, env, comm)
        if self.mesh is None:
            self.mesh = Mesh(self.layout_for(env.world_size, env.local_world_size), self.comm, AXES_USED)
        self.layout, coords = self.mesh.layout, self.mesh.coords
        self.tp_comm = self.mesh.comm("tp")
        # ranks holding different tokens: counts and metrics are summed over them, gradients too (the sharding
        # engine's group takes in the context-parallel ranks: torchtitan's dp_shard x cp)
        self.dp_comm = self.mesh.comm(("dp_replicate", "dp_shard", "cp"))
        shard, replicate = self.mesh.comm(("dp_shard", "cp")), self.mesh.comm("dp_replicate")
        # attention's traffic rides on the sharding engine's communicator, between the ranks of this cp group
        peers = self.layout.group(self.mesh.world.rank, ("cp",))
        ring = [shard.ranks.index(self.mesh.world.ranks[p]) for p in peers] if self.layout.cp > 1 else None
        self._cp = ContextParallel(shard, self.cp_method, ring) if ring is not None else None
        if self.layout.dp_shard * self.layout.cp > 1:
            self.inner = get_strategy("fsdp", reshard_after_forward=self.reshard_after_forward, prefetch=self.prefetch,
                                      reduce_dtype=self.reduce_dtype)
            self.inner.replicate = replicate  # type: ignore[attr-defined]  # HSDP: shards all-reduced across replicas
            group = shard
        elif self.layout.dp_replicate > 1:
            self.inner, group = get_strategy("ddp", bucket_mb=self.bucket_mb), replicate
        else:
            self.inner, group = get_strategy("single"), shard  # a group of one
        self.tp_rank = coords["tp"]
        self.inner.setup_environment(
            dataclasses.replace(env, rank=group.rank, local_rank=group.rank, world_size=group.world_size), comm=group)

    @property
    def dp_rank(self) -> int:
        """The rank's batch: the context- and tensor-parallel ranks of one data-parallel coordinate read the same."""
        assert self.mesh is not None
        return self.mesh.coords["dp_replicate"] * self.layout.dp_shard + self.mesh.coords["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def item_ranks(self) -> int:
        """Ranks whose items count apart: the data-parallel ones and, each with its own tokens, the context-parallel
        ones."""
        return self.layout.dp * self.layout.cp

    def local_batch(self, batch: Any) -> Any:
        """Under context parallelism this rank's two chunks of every sequence (dimension 1 of every tensor of two
        or more dimensions); the batch as it is otherwise."""
        if self._cp is None:
            return batch
        cp = self._cp
        return apply_to_collection(batch, Tensor, lambda t: shard_sequence(t, cp.rank, cp.size) if t.dim() >= 2
                                   else t)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with self.inner.forward_context(), context_parallel(self._cp):  # attention across the cp group, if any
            yield

    def backward(self, loss: Tensor, gradient: Tensor | None = None) -> None:
        with context_parallel(self._cp):  # recomputed blocks (activation checkpointing) attend across the group
            self.inner.backward(loss, gradient)

    @property
    def counts_items(self) -> bool:
        return self.tp_rank == 0  # the tensor-parallel ranks of a data-parallel coordinate see the same samples

    # -- transforms and setup ------------------------------------------------------------------------
    def parallelize(self, module: nn.Module) -> None:
        """Tensor parallelism, applied to the whole model before any engine sees it: every layer its
        ``tensor_parallel_plan()`` names cut to this rank's part (a pipeline cuts the stages afterwards, and the
        engine shards what this leaves). Every tensor-parallel rank starts from tensor-parallel rank 0's values."""
        self._whole_shape = {p: tuple(p.shape) for p in module.parameters()}
        if self.tp > 1:
            plan = getattr(module, "tensor_parallel_plan", None)
            if not callable(plan):
                raise TypeError(
                    f"Strategy 'parallel' with tp={self.tp} needs {type(module).__name__} to define "
                    "tensor_parallel_plan() -> {submodule pattern: style} (which layers are split, and how); see "
                    "docs/parallel.md, or run with tp=1."
                )
            self._same_start(module)
            self.applied = apply_plan(module, plan(), self.tp_comm, self.sequence_parallel)
        self._sync_metrics_over_data(module)
        self._parallelized = True

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        """The engine on ``module`` (the model ``parallelize`` transformed, or a pipeline stage of it; a module no
        one parallelized is parallelized first)."""
        if not self._parallelized:
            self.parallelize(module)
        self._bind(module, optimizer, precision)
        names = st.param_names(module)
        self._whole_shapes = {n: self._whole_shape.get(p, tuple(p.shape)) for p, n in names.items()}
        self._strided = {names[p]: st.Strided(*split.strides(self._whole_shapes[names[p]], self.tp_rank))
                         for p, split in self.applied.splits.items() if p in names}
        self._replicated = [p for p in module.parameters() if p not in self.applied.splits]
        if self.tp > 1:
            self.inner.keep_apart(self._replicated)  # summed across tp, counted once
        self.inner.setup(module, optimizer, precision)
        self._parallelized = False  # the next module set up is parallelized anew

    def whole_shape(self, param: Tensor) -> tuple[int, ...]:
        """``param``'s shape before tensor parallelism cut it."""
        return self._whole_shape.get(param, tuple(param.shape))

    def _sync_metrics_over_data(self, module: nn.Module) -> None:
        """torchmetrics objects on the module sync over the data-parallel ranks only: the tensor-parallel ranks of
        one data-parallel coordinate saw the same samples, and counting them tp times would multiply every sum."""
        for metric in module.modules():
            if hasattr(metric, "sync_on_compute") and hasattr(metric, "process_group"):  # a torchmetrics Metric
                if self.dp_comm.world_size > 1:
                    metric.process_group = self.dp_comm.group
                elif self.tp_comm.world_size > 1:
                    metric.sync_on_compute = metric._to_sync = False  # no other rank read other data

    def _same_start(self, module: nn.Module) -> None:
        """Every tensor-parallel rank cuts its part from tensor-parallel rank 0's values (a rank that drew other
        initial values would otherwise train a model no single process has)."""
        with torch.no_grad():
            for p in module.parameters():
                if not p.is_meta:
                    on_device = p.data.to(self.device)
                    self.tp_comm.broadcast(on_device, src=0)
                    p.data.copy_(on_device)

    # -- gradients -----------------------------------------------------------------------------------
    def reduce_gradients(self, scale: float | Tensor) -> None:
        self.inner.reduce_gradients(scale)
        if self.sequence_parallel and self.tp_comm.active:  # each rank saw a slice of the sequence: partial sums
            grads = self.inner.gradients_of(self._replicated)
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            for group in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in group])
                self.tp_comm.all_reduce(flat)
                offset = 0
                for g in group:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        """The inner strategy's norm of this rank's slices (whole parameters counted on tensor-parallel rank 0
        only), combined across the tensor-parallel group."""
        others = self._replicated if self.tp_rank != 0 else []
        return combine_norm(self.inner.grad_norm(norm_type, [*exclude, *others]), norm_type, self.tp_comm)

    def own_comms(self) -> list[Comm]:
        return [self.tp_comm, self.dp_comm]

    def comms_by_axis(self) -> dict[str, list[Comm]]:
        assert self.mesh is not None
        axes = {"tp": [self.tp_comm], "dp_shard": [self.mesh.comm(("dp_shard", "cp"))],
                "dp_replicate": [self.mesh.comm("dp_replicate")]}
        listed = {id(c) for comms in axes.values() for c in comms}
        axes["dp"] = [self.dp_comm, *(c for c in self.inner.comms() if id(c) not in listed)]
        return axes

    # -- planning ------------------------------------------------------------------------------------
    def unfit_for(self, module: nn.Module, optimizer: Optimizer | None) -> str | None:
        return unplanned(module, self.tp) or super().unfit_for(module, optimizer)

    def describe(self) -> str:
        return str(self.layout) + ("" if self.sequence_parallel or self.tp == 1 else ", no sequence parallelism")

    def activation_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return split_for_trace(model, self.tp, self.sequence_parallel, device)

    # -- metrics ---------------------------------------------------------------------------------------
    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Across the data-parallel ranks (the tensor-parallel ranks of one hold the same values)."""
        if not self.dp_comm.active:
            return tensor
        out = tensor.detach().clone().to(self.device)
        self.dp_comm.all_reduce(out, "sum" if op == "mean" else op)
        return out / self.dp_comm.world_size if op == "mean" else out

    # -- state -------------------------------------------------------------------------------------
    def state_layout(self) -> st.StateLayout:
        """The inner strategy's holders with each split parameter's part described (``Strided``) and whole shapes;
        a part is written by one replica, a whole parameter by tensor-parallel rank 0 of it."""
        assert self.mesh is not None
        inner = self.inner.state_layout()
        first_replica = self.mesh.coords["dp_replicate"] == 0

        def convert(holder: st.Holder) -> st.Holder:
            segments = tuple(dataclasses.replace(s, strided=self._strided.get(s.name)) for s in holder.segments)
            split = bool(segments) and all(s.strided is not None for s in segments)
            return st.Holder(holder.tensor, segments, holder.write and first_replica and (split or self.tp_rank == 0))

        return st.StateLayout({**inner.shapes, **self._whole_shapes}, [convert(h) for h in inner.model],
                              inner.optimizer, [convert(h) for h in inner.optimizer_holders], inner.group_names)

    def _whole(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Split tensors made whole from every tensor-parallel rank's part (collective over the group)."""
        if not self.tp_comm.active:
            return tensors
        assert self.module is not None
        split_of = {n: self.applied.splits[p] for n, p in self.module.named_parameters() if p in self.applied.splits}
        out = {}
        for name, t in tensors.items():
            split = split_of.get(name)
            if split is None:
                out[name] = t
                continue
            t = t.contiguous()
            parts = t.new_empty((self.tp_comm.world_size, *t.shape))
            self.tp_comm.all_gather(parts.view(-1), t.view(-1))
            out[name] = split.whole(list(parts))
        return out

    def full_parameters(self) -> dict[str, Tensor]:
        return self._whole(self.inner.full_parameters())

    def full_gradients(self) -> dict[str, Tensor]:
        return self._whole(self.inner.full_gradients())


def unplanned(module: nn.Module, tp: int) -> str | None:
    if tp > 1 and not callable(getattr(module, "tensor_parallel_plan", None)):
        return "the module has no tensor_parallel_plan()"
    return None


def split_for_trace(model: nn.Module, tp: int, sequence_parallel: bool, device: torch.device) -> nn.Module:
    """``model`` with its plan applied as one tensor-parallel rank computes it, over a ``PlanComm`` (collectives
    counted, none performed: the shapes and the bytes saved for backward are a rank's)."""
    if tp > 1:
        apply_plan(model, model.tensor_parallel_plan(), PlanComm(tp, 0, device), sequence_parallel)
    return model


def check_degrees(**degrees: int | None) -> None:
    bad = [f"{k}={v}" for k, v in degrees.items() if v is not None and (not isinstance(v, int) or v < 1)]
    if bad:
        raise ValueError(f"parallel: every degree must be a whole number of at least 1; got {', '.join(bad)}.")


def resolve_layout(world_size: int, ranks_per_node: int, tp_across_nodes: bool, pp: int, tp: int, dp_replicate: int,
                   dp_shard: int | None, cp: int = 1) -> Layout:
    """The layout of these degrees at ``world_size`` (``dp_shard`` None: what the others leave), checked."""
    if dp_shard is None:
        rest = pp * tp * dp_replicate * cp
        if world_size % rest:
            raise ValueError(f"parallel: pp={pp} x tp={tp} x cp={cp} x dp_replicate={dp_replicate} = {rest} does not "
                             f"divide the {world_size} ranks; choose degrees whose product divides the world "
                             "(dp_shard takes what is left).")
        dp_shard = world_size // rest
    layout = Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
    layout.check(world_size, ranks_per_node or None, tp_across_nodes)
    return layout


class PipelinedParallel(PipelineStrategy, Parallelizes):
    """What ``ParallelStrategy(pp=...)`` with ``pp`` > 1 builds (same arguments): the pipeline's schedules between
    stages, and in each stage a ``ParallelStrategy`` on the stage's ranks."""

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
        self._parallelized = False

    def layout_for(self, world_size: int, ranks_per_node: int = 0) -> Layout:
        return resolve_layout(world_size, ranks_per_node, self.options["tp_across_nodes"], pp=self.pp, tp=self.tp,
                              dp_replicate=self.dp_replicate, dp_shard=self.dp_shard)

    def _layout(self, world_size: int) -> Layout:
        return self.layout_for(world_size, self.env.local_world_size)

    def _mesh_axes(self) -> list[tuple[str, ...]]:
        return [*super()._mesh_axes(), *AXES_USED]

    def parallelize(self, module: nn.Module) -> None:
        """Tensor parallelism on the whole model (the plan names its submodules), before the stages are cut."""
        assert isinstance(self.inner, ParallelStrategy)
        self.inner.parallelize(module)
        self._parallelized = True

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        if not self._parallelized:  # driven by hand: the module is parallelized here
            self.parallelize(module)
        super().setup(module, optimizer, precision)
        self._parallelized = False

    def _shape(self, param: Tensor) -> tuple[int, ...]:
        assert isinstance(self.inner, ParallelStrategy)
        return self.inner.whole_shape(param)

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
