"""``strategy="parallel"``: data, tensor (and sequence) and pipeline parallelism at once, on one layout of the ranks.

The world is the grid ``pp x dp_replicate x dp_shard x cp x tp`` (``layout.py``). A rank holds:

- with ``tp`` > 1, its slice of every layer the module's ``tensor_parallel_plan()`` names (Megatron-LM; under
  ``sequence_parallel`` the norms, dropouts and residuals between those layers work on its slice of the sequence:
  Korthikanti et al., 2022);
- with ``dp_shard`` > 1, 1/dp_shard of that slice (the FSDP engine over the ``dp_shard`` group, units as ``fsdp``
  chooses them); with ``dp_replicate`` > 1 as well, the shards are replicated and their gradients all-reduced
  across replicas once per step (HSDP); with only ``dp_replicate``, ``ddp`` among the replicas;
- with ``pp`` > 1, one stage's layers (``pipeline_layers()``), the pipeline's schedules running between stages and
  all of the above inside each stage (``pipeline/transform.py``);
- with ``cp`` > 1, two of ``2 x cp`` chunks of every sequence (``local_batch``), attention running across the
  context-parallel group (``context/ring.py``) and parameters sharded over ``dp_shard x cp``.

Each of tp, ep, cp and pp is an ``Axis`` (``trainkit_strategies/axis.py``; its folder's ``transform.py``), and every
part of a step loops over the active ones in the order of ``AXES``: transform the model, cut this rank's part,
reduce the gradients after the engine has, combine norms, name checkpoint pieces, gather tensors whole. Gradients of
parameters the plan leaves whole are summed across the tensor-parallel group under sequence parallelism (each rank
saw a slice of the sequence) and counted once in norms; the batch is read once per data-parallel coordinate, by all
the tensor-parallel ranks of it; checkpoints hold each parameter's part as a strided piece, so they resume under any
strategy and layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.axis import Axis
from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import BuildsOnMeta, Parallelizes, RunsSchedule, StepsInBackward
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.communication.layout import Layout, Mesh, check_degrees, resolve_layout
from trainkit_strategies.context.ring import METHODS
from trainkit_strategies.context.transform import ContextAxis
from trainkit_strategies.experts.transform import ExpertParallel
from trainkit_strategies.init.materialise import name_meta_tensors
from trainkit_strategies.pipeline.executor import STAGE_AXES, Pipeline, check_schedule
from trainkit_strategies.pipeline.microbatches import missing_hooks
from trainkit_strategies.pipeline.transform import PipelineAxis
from trainkit_strategies.precision import Precision
from trainkit_strategies.registry import get_strategy, strategy_class
from trainkit_strategies.state import pieces as st
from trainkit_strategies.tensor.planned import split_for_trace, unplanned
from trainkit_strategies.tensor.transform import TensorParallel
from trainkit_strategies.wrapper import Wrapper

AXES_USED = [("tp",), ("dp_shard", "cp"), ("dp_replicate",), ("dp_replicate", "dp_shard", "ep", "cp"),
             ("pp", "dp_replicate", "dp_shard", "ep", "cp"), ("cp",), ("ep",), ("cp", "tp"), ("ep", "tp")]
ENGINES = ("ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp")  # every one-axis preset is one of these
AXES: tuple[type[Axis], ...] = (TensorParallel, ExpertParallel, ContextAxis, PipelineAxis)  # applied in this order


class ParallelStrategy(Wrapper, Parallelizes):
    """Several parallelisms at once, on one layout of the ranks: the constructor every composed layout is built by
    (``pipeline`` is one of its presets). From the command line: ``--trainer.strategy parallel
    --trainer.strategy.tp 2 --trainer.strategy.dp_shard 2``.

    It nests one strategy: the data-parallel engine of the ranks holding the same slices of a stage (``fsdp``,
    ``ddp``, ``zero1``, ``zero2`` or ``single``); tensor, expert and context parallelism and the pipeline's stages
    and schedule are its axes (``axes``, made in ``AXES`` order: ``tensor/``, ``experts/``, ``context/``,
    ``pipeline/``, each with its ``transform.py``).

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
            overlapped with attention), "all_gather" (gathered whole once per layer, as Llama 3 does) or "ulysses"
            (all-to-alls trade sequence slices for head slices and back; the heads must divide by cp).
        ep: expert parallelism: the experts of every ``trainkit.moe.MoE`` layer divided among this many ranks,
            drawn from the data-parallel ones (they read different batches), tokens sent to their experts by
            all-to-all. Everything else is replicated across them (sharded by the other axes as without ep).
        sequence_parallel: under tp, shard the regions between tensor-parallel layers along the sequence too (the
            activations of norms, dropouts and residuals divided by tp; the same bytes communicated).
        microbatches, schedule, virtual_stages, split: the pipeline's, as for ``strategy="pipeline"``.
        reshard_after_forward, prefetch: the sharding engine's, as for ``fsdp`` (its reduce_dtype: the precision
            policy's, as for every strategy).
        bucket_mb: the bucket size of ddp and the ZeRO stages.
        tp_across_nodes: allow a tensor-parallel group to span nodes (its all-reduces then cross the network).
        data_parallel: the engine of the data-parallel axes. Default: ``fsdp`` where parameters are sharded
            (``dp_shard x cp`` > 1; HSDP with ``dp_replicate``), ``ddp`` where they are only replicated. ``zero1``,
            ``zero2`` and ``zero_offload`` shard gradients and optimizer state over ``dp_shard`` and keep parameters
            whole; ``zero3`` shards parameters as ``fsdp`` does, one unit per module. A one-axis strategy by name is
            its engine alone: ``zero2`` is this layout's ``dp_shard=world, data_parallel="zero2"`` without the
            wrapper.
        engine_options: the engine's own options, as its strategy takes them (``{"find_unused_parameters": True}``
            for ddp, ``{"ratio": 0.5}`` for zero_offload, ...).
    """

    name = "parallel"
    manual_optimization = False  # its axes step as one: tp/ep sums, pipeline stages running their own schedule

    def __init__(self, tp: int = 1, dp_shard: int | None = None, dp_replicate: int = 1, pp: int = 1,
                 sequence_parallel: bool = True, microbatches: int = 4, schedule: str = "1f1b",
                 virtual_stages: int = 1, split: list[int] | None = None, reshard_after_forward: bool = True,
                 prefetch: bool = True, bucket_mb: float = 25.0,
                 tp_across_nodes: bool = False, cp: int = 1, cp_method: str = "ring",
                 data_parallel: str | None = None, engine_options: dict[str, Any] | None = None, ep: int = 1) -> None:
        super().__init__()
        check_degrees(tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, pp=pp, cp=cp, ep=ep)
        if cp_method not in METHODS:
            raise ValueError(f"parallel cp_method must be one of {METHODS}; got {cp_method!r}.")
        if data_parallel is not None and data_parallel not in ENGINES:
            raise ValueError(f"{self.name} data_parallel must be one of {', '.join(ENGINES)}; got {data_parallel!r}.")
        if cp > 1 and pp > 1:
            raise ValueError(f"parallel: cp={cp} with pp={pp} is not supported yet (context parallelism runs with "
                             "tp, dp_shard and dp_replicate): use pp=1, or cp=1.")
        self.tp, self.dp_shard, self.dp_replicate, self.pp = tp, dp_shard, dp_replicate, pp
        self.cp, self.cp_method, self.ep = cp, cp_method, ep
        self.axes: list[Axis] = []  # the active ones, in ``AXES`` order (``setup_environment`` makes them)
        self.sequence_parallel = sequence_parallel and tp > 1
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.bucket_mb, self.tp_across_nodes, self.data_parallel = bucket_mb, tp_across_nodes, data_parallel
        self.engine_options = dict(engine_options or {})
        if self.engine_options and data_parallel is None:
            raise ValueError(f"{self.name} engine_options are options of one engine: name it with data_parallel "
                             "(ddp, zero1, zero2, zero_offload, zero3 or fsdp).")
        self.pipeline = Pipeline(microbatches, schedule, virtual_stages, split) if pp > 1 else None
        if self.pipeline is not None and (data_parallel or (dp_shard or 0) > 1):
            check_schedule(schedule, data_parallel or "fsdp")
        self.mesh: Mesh | None = None
        self.inner: Strategy = get_strategy("single")
        self._whole_shapes: dict[str, tuple[int, ...]] = {}
        self._whole_shape: dict[Tensor, tuple[int, ...]] = {}  # by parameter, as parallelize found them
        self._parallelized = False

    # -- layout --------------------------------------------------------------------------------------
    def layout_for(self, world_size: int, ranks_per_node: int = 0) -> Layout:
        """The layout at ``world_size`` ranks, checked: ``dp_shard`` takes what the others leave, or ``dp_replicate``
        does where it is 1 and the named engine replicates (``data_parallel="ddp"``)."""
        replicates = self.data_parallel is not None and strategy_class(self.data_parallel).data_axis == "dp_replicate"
        if self.dp_shard is None and self.dp_replicate == 1 and replicates:
            layout = resolve_layout(world_size, ranks_per_node, self.tp_across_nodes, pp=self.pp, tp=self.tp,
                                    dp_replicate=1, dp_shard=None, cp=self.cp, ep=self.ep)
            layout = Layout(pp=layout.pp, dp_replicate=layout.dp_shard, dp_shard=1, cp=layout.cp, tp=layout.tp,
                            ep=layout.ep)
            layout.check(world_size, ranks_per_node or None, self.tp_across_nodes)
            return layout
        return resolve_layout(world_size, ranks_per_node, self.tp_across_nodes, pp=self.pp, tp=self.tp,
                              dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, ep=self.ep)

    def setup_environment(self, env: Environment, comm: Comm | None = None) -> None:
        Strategy.setup_environment(self, env, comm)
        axes = [*AXES_USED, ("pp",), STAGE_AXES] if self.pipeline is not None else AXES_USED
        self.mesh = Mesh(self.layout_for(env.world_size, env.local_world_size), self.comm, axes)
        self.layout = self.mesh.layout
        self.tp_comm = self.mesh.comm("tp")
        # ranks holding different tokens: counts and metrics are summed over them, gradients too (the sharding
        # engine's group takes in the context-parallel ranks: torchtitan's dp_shard x cp)
        self.dp_comm = self.mesh.comm(("dp_replicate", "dp_shard", "ep", "cp"))
        self.items_comm = self.mesh.comm(("pp", "dp_replicate", "dp_shard", "ep", "cp"))  # every rank but tp's peers
        self.axes = [axis for axis in (kind.of(self) for kind in AXES) if axis is not None]
        name, group = self._engine(self.layout)
        self.inner = self._make_engine(name)
        local = dataclasses.replace(env, rank=group.rank, local_rank=group.rank, world_size=group.world_size)
        replicate = self.mesh.comm("dp_replicate")
        if replicate.active and self.layout.dp_shard * self.layout.cp > 1:  # HSDP: shards all-reduced across replicas
            self.inner.setup_environment(local, comm=group, replicas=replicate)  # type: ignore[call-arg]
        else:
            self.inner.setup_environment(local, comm=group)

    def _engine(self, layout: Layout) -> tuple[str, Comm]:
        """The data-parallel engine's name and communicator on ``layout``: ``data_parallel`` (by default fsdp where
        parameters are sharded, ddp where they are replicated), checked against the axis it runs along."""
        assert self.mesh is not None
        sharded = layout.dp_shard * layout.cp > 1
        if not sharded and layout.dp_replicate == 1:
            return "single", self.mesh.comm(("dp_shard", "cp"))  # a group of one
        name = self.data_parallel or ("fsdp" if sharded else "ddp")
        engine = strategy_class(name)
        if engine.data_axis != ("dp_shard" if sharded else "dp_replicate") or (
                sharded and layout.dp_shard < layout.dp_shard * layout.cp * layout.dp_replicate and not engine.hybrid):
            raise ValueError(f"{self.name}: data_parallel={name!r} cannot run {layout}: ddp replicates (dp_replicate "
                             "alone), zero1 and zero2 shard over dp_shard alone, fsdp shards over dp_shard x cp and "
                             "replicates the shards over dp_replicate (HSDP).")
        if self.pipeline is not None:
            check_schedule(self.pipeline.schedule, name)
        return name, self.mesh.comm(("dp_shard", "cp") if sharded else "dp_replicate")

    def _make_engine(self, name: str) -> Strategy:
        chunks_in_turn = self.pipeline is not None and self.pipeline.virtual_stages > 1  # no one order to prefetch
        options = dict(bucket_mb=self.bucket_mb, prefetch=self.prefetch and not chunks_in_turn,
                       reshard_after_forward=self.reshard_after_forward)
        accepted = inspect.signature(strategy_class(name)).parameters
        if name == self.data_parallel:
            unknown = sorted(set(self.engine_options) - set(accepted))
            if unknown:
                raise ValueError(f"{self.name} engine_options {unknown} are not options of {name!r}; its options are "
                                 f"{', '.join(accepted)}.")
            options |= self.engine_options
        return get_strategy(name, **{k: v for k, v in options.items() if k in accepted})

    def data_comm(self) -> Comm:
        return self.dp_comm

    @property
    def dp_rank(self) -> int:
        """The rank's batch: the context- and tensor-parallel ranks of one data-parallel coordinate read the same."""
        assert self.mesh is not None
        coords = self.mesh.coords
        return (coords["dp_replicate"] * self.layout.dp_shard + coords["dp_shard"]) * self.layout.ep + coords["ep"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def item_ranks(self) -> int:
        """Ranks whose items count apart: the data-parallel ones and, each with its own tokens, the context-parallel
        ones."""
        return self.layout.dp * self.layout.cp

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of the batch: under context parallelism its two chunks of every sequence."""
        for axis in self.axes:
            batch = axis.local_batch(batch)
        return batch

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.pipeline is not None:
            return contextlib.nullcontext()  # the schedule applies the engine's around each stage's forward
        return self.inner.forward_context()

    def ability(self, kind: type) -> Any:
        """Its pipeline runs the schedules (``RunsSchedule``) when it has stages; the engine steps during backward
        (``StepsInBackward``: zero_offload) where no axis of this layout acts on gradients after the engine's
        reduction (no tensor- or expert-parallel sum, no tied stages)."""
        if kind is RunsSchedule:
            return self.pipeline
        if kind is BuildsOnMeta:  # built on meta under the engine's recording, cut there by the axes, then the
            return self.inner.ability(kind)  # engine materialises what this rank keeps (``init/materialise.py``)
        if kind is StepsInBackward and not any(axis.acts_on_gradients and axis.comm.active for axis in self.axes):
            return self.inner.ability(kind)
        return super().ability(kind)

    # -- transforms and setup ------------------------------------------------------------------------
    def parallelize(self, module: nn.Module) -> None:
        """The axes' transforms, applied to the whole model before any engine sees it, in ``AXES`` order (tensor
        parallelism cuts its planned layers, expert parallelism its experts, context parallelism installs its group;
        a pipeline cuts the stages in ``setup``, and the engine shards what they leave)."""
        self._whole_shape = {p: tuple(p.shape) for p in module.parameters()}
        name_meta_tensors(module)  # read from files by these names once stages have renamed them
        for axis in self.axes:
            axis.transform(module, self.device)
        self._sync_metrics_over_data(module)
        self._parallelized = True

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        """The engine on ``module`` (the model ``parallelize`` transformed; a module no one parallelized is
        parallelized first), or on this rank's part of it (its pipeline stage)."""
        if not self._parallelized:
            self.parallelize(module)
        self._bind(module, optimizer, precision)
        target = module
        shapes, _ = self._whole_state(skip=set())
        for axis in self.axes:
            target = axis.local_module(target, optimizer, self.inner, self.whole_shape, shapes)
        names = st.param_names(target)
        self._whole_shapes = {n: self.whole_shape(p) for p, n in names.items()}
        for axis in self.axes:
            axis.bind(target, names, self.inner, self._whole_shapes)
        self.inner.setup(target, optimizer, precision)
        for axis in self.axes:
            axis.opened(module, self.inner)
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

    # -- gradients -----------------------------------------------------------------------------------
    def reduce_gradients(self, scale: float | Tensor) -> None:
        """The engine's reduction over the data-parallel ranks, then each axis's (``Axis.reduce_gradients``)."""
        self.inner.reduce_gradients(scale)
        for axis in self.axes:
            axis.reduce_gradients(self.inner)

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        """The engine's norm of this rank's parts, leaving out what another rank of an axis counts (a whole
        parameter on tensor-parallel rank 0 only, a parameter tied across stages on its first stage), combined across
        each axis's group."""
        elsewhere = [p for axis in self.axes for p in axis.counted_elsewhere()]
        norm = self.inner.grad_norm(norm_type, [*exclude, *elsewhere])
        for axis in self.axes:
            norm = axis.combine_norm(norm, norm_type)
        return norm

    def own_comms(self) -> list[Comm]:
        unique = {id(c): c for c in [self.tp_comm, self.dp_comm, *(c for axis in self.axes for c in axis.comms())]}
        return list(unique.values())

    def comms_by_axis(self) -> dict[str, list[Comm]]:
        assert self.mesh is not None
        axes = {"tp": [self.tp_comm], "dp_shard": [self.mesh.comm(("dp_shard", "cp"))],
                "dp_replicate": [self.mesh.comm("dp_replicate")], "ep": [self.mesh.comm("ep")]}
        for axis in self.axes:
            axes.setdefault(axis.name, axis.comms())
        listed = {id(c) for comms in axes.values() for c in comms}
        axes["dp"] = [self.dp_comm, *(c for c in self.inner.comms() if id(c) not in listed)]
        return axes

    # -- planning ------------------------------------------------------------------------------------
    def unfit_for(self, module: nn.Module, optimizer: Optimizer | None) -> str | None:
        missing = missing_hooks(module) if self.pipeline is not None else []
        if missing:
            return f"the module has no {' or '.join(f'{m}()' for m in missing)}"
        return unplanned(module, self.tp) or super().unfit_for(module, optimizer)

    def planned(self, module: nn.Module, world_size: int) -> tuple[Strategy, list[int]]:
        """With stages, the first rank of every stage is planned (each holds other layers)."""
        if self.pipeline is None:
            return super().planned(module, world_size)
        return self, [stage * (world_size // self.pp) for stage in range(self.pp)]

    def describe(self) -> str:
        return ", ".join([str(self.layout), *(d for d in (axis.describe() for axis in self.axes) if d)])

    def activation_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return split_for_trace(model, self.tp, self.sequence_parallel, device)

    # -- metrics ---------------------------------------------------------------------------------------
    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Across every rank but a tensor-parallel group's peers, which hold the same values (a pipeline's item counts:
        every last-stage rank counts its micro-batches' items, summed over the stages and the data-parallel ranks)."""
        if not self.items_comm.active:
            return tensor
        out = tensor.detach().clone().to(self.device)
        self.items_comm.all_reduce(out, "sum" if op == "mean" else op)
        return out / self.items_comm.world_size if op == "mean" else out

    def reduce_tokens(self, tensor: Tensor, op: str = "sum") -> Tensor | None:
        """Across the context-parallel group (its ranks hold the other chunks of this rank's sequences)."""
        cp = self.mesh.comm("cp") if self.mesh is not None else None
        if cp is None or not cp.active:
            return None
        out = tensor.detach().clone().to(self.device)
        cp.all_reduce(out, op)
        return out

    # -- state -------------------------------------------------------------------------------------
    def state_layout(self) -> st.StateLayout:
        """The engine's holders with each axis's part described (a divided parameter's piece as ``Strided``, whole
        shapes; a part written by one replica, a whole parameter by each axis's first rank), under the module's
        names."""
        assert self.mesh is not None
        inner = self.inner.state_layout()
        first_replica = self.mesh.coords["dp_replicate"] == 0
        layout = st.StateLayout({**inner.shapes, **self._whole_shapes},
                                [dataclasses.replace(h, write=h.write and first_replica) for h in inner.model],
                                inner.optimizer,
                                [dataclasses.replace(h, write=h.write and first_replica) for h in
                                 inner.optimizer_holders], inner.group_names)
        for axis in self.axes:
            layout = axis.state(layout, self._group_names)
        return layout

    def _whole(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Tensors made whole across every axis (collective over each group), in ``AXES`` order."""
        for axis in self.axes:
            tensors = axis.whole(tensors)
        return tensors

    def full_parameters(self) -> dict[str, Tensor]:
        return self._whole(self.inner.full_parameters())

    def full_gradients(self) -> dict[str, Tensor]:
        return self._whole(self.inner.full_gradients())

