"""Parameter sharding, ZeRO-3 and FSDP style: one engine, two grouping policies (``zero3.py``, ``fsdp.py``).

Every rank stores 1/N of every parameter (ZeRO paper §5.3). Parameters are grouped into *units* (module
groups gathered together); a unit's parameters are laid out in ``ShardedBucket``s, one per optimizer
param group it holds. A bucket is one record: its flat layout, its gather buffer (whose storage exists
only while the unit is gathered: ``storage.resize_``, as FSDP does; the module's parameters are views
into it, so autograd's saved tensors see the data again when backward re-gathers), this rank's piece
in the compute dtype, and its gradient shard. The lifecycle of a unit in one step:

1. forward pre-hook: all-gather the unit (waiting for a prefetch if one was issued), and issue the
   next unit's all-gather asynchronously (the order is recorded on the first step);
2. forward hook: free the gathered parameters when the next unit's forward starts (``reshard_after_forward``;
   off keeps them, ZeRO-2-like): the last unit stays gathered for backward, which begins with it;
3. backward pre-hook: all-gather again (the last unit excepted), prefetch the next unit in backward order;
4. when every parameter of the unit has its gradient: copy the gradients into one of two bucket buffers
   (taken in turn: the next unit's reduce-scatter starts while this one is still on the wire), reduce-scatter
   into the rank's gradient shard (accumulating across micro-steps), free the unit.

Parameters outside every unit form the *root* unit, gathered from the start of the step's forward to
the end of its backward. Communication per step: Ψ gathered twice (the last unit once) and Ψ reduce-scattered
(§7: 3Ψ). Mixed precision follows FSDP's policy: fp32 sharded master, gathers in the compute dtype, gradients
reduced in the policy's ``reduce_dtype`` (default: the compute dtype). The optimizer steps the master pieces
(``MasterShards``, shared with ZeRO-1/2, including offload). Models built in ``configure_model`` on the
meta device are materialised one tensor at a time, each rank keeping its range (``trainkit_strategies/init``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from functools import partial

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import ShardedInit
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.init.materialise import RecordsInit
from trainkit_strategies.planning.memory import MemoryReport, resize_storage
from trainkit_strategies.precision import Precision
from trainkit_strategies.sharding.units import ShardedBucket, Unit, UnitOrder, assign_units, on_first_grad, weakly
from trainkit_strategies.state import pieces as st
from trainkit_strategies.state.flat import BucketReducer, FlatBucket, OrderedLauncher
from trainkit_strategies.state.master import DeferredGradScale, FixedGroups, MasterShards


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ShardedStrategy(RecordsInit, DeferredGradScale, FixedGroups, Strategy, ShardedInit):
    """The ZeRO-3 / FSDP engine; subclasses choose the units (``unit_modules``) and persistent params.

    Args:
        reshard_after_forward: free gathered parameters after each unit's forward (gather again for
            backward). Off keeps them until the unit's backward: less communication, more memory.
        prefetch: issue the next unit's all-gather while the current one computes.
        offload: keep master weights and optimizer state in host memory (as ZeRO-Offload).
        ratio: with ``offload``, the fraction of the optimizer state kept on the host.
        broadcast_buffers: broadcast rank 0's floating-point buffers (e.g. BatchNorm statistics) after
            every step, as ddp does.
    """

    data_axis, hybrid = "dp_shard", True  # shards over dp_shard x cp, replicated over dp_replicate (HSDP)
    any_reduce_dtype = True
    splits_backward = False  # a unit's gathered parameters are freed and its gradients reduced after its backward

    def __init__(self, reshard_after_forward: bool = True, prefetch: bool = True, offload: bool = False,
                 ratio: float = 1.0, broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.broadcast_buffers = broadcast_buffers
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in [0, 1]; got {ratio}.")
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.offload, self.ratio = offload, ratio
        self.units: list[Unit] = []
        self.buckets: list[ShardedBucket] = []  # in reduce-scatter launch order (bucket.index)
        self._bucket_of: dict[Tensor, ShardedBucket] = {}
        self._grad_buffer: list[Tensor] = []  # the one flat tensor every gradient shard is a view of
        self._launcher = OrderedLauncher([], self._launch)
        self._reducer = BucketReducer(self.comm, torch.float32, torch.device("cpu"), 0)
        self._hooks: list = []
        self.sync_micro_steps = True  # reduce-scatter on micro-steps too (ZeRO-3); fsdp can turn it off
        self._first_micro_step = True
        self._end_queued = False
        self._order = UnitOrder()
        self._apart: list[set[int]] = []  # ids of parameters whose gradients keep_apart gave buckets of their own
        self.replicate: Comm | None = None  # HSDP (setup_environment's replicas)
        self._finished: Unit | None = None  # the last unit whose training forward ended, still gathered

    def setup_environment(self, env: Environment, comm: Comm | None = None, replicas: Comm | None = None) -> None:
        """``replicas``: the ranks holding the same shards, their gradients all-reduced once per step (HSDP)."""
        super().setup_environment(env, comm)
        self.replicate = replicas

    # -- policy --------------------------------------------------------------------------------------
    def unit_modules(self, module: nn.Module) -> list[list[nn.Module]]:
        """The modules of each unit, outermost first (a unit may nest inside another)."""
        raise NotImplementedError

    def is_persistent(self, param: Tensor) -> bool:
        """Parameters kept gathered all the time (still sharded for the optimizer)."""
        return False

    # -- setup ---------------------------------------------------------------------------------------
    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduce-scattered and kept in (the policy's ``reduce_dtype``)."""
        return self.precision.grad_dtype

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        self._bind(module, optimizer, precision)
        names = st.param_names(module)
        trainable = {n for p, n in names.items() if p.requires_grad}
        group_of = {n: g for g, group in enumerate(self._group_names) for n in group if n in trainable}
        groups = len(self._group_names) + 1  # the last holds parameters the optimizer does not train
        for handle in self._hooks:
            handle.remove()
        for mod in module.modules():  # parameters move unit by unit, as they are sharded
            for key, buf in mod._buffers.items():
                if buf is not None and not buf.is_meta:
                    mod._buffers[key] = buf.to(self.device)
        self.units, params_of = assign_units(module, names, self.unit_modules(module), self.is_persistent)
        layouts: dict[int, list[FlatBucket]] = {}

        def key(p: Tensor) -> tuple[int, ...]:  # a bucket per param group, and per the sets kept apart it is in
            return group_of.get(names[p], groups - 1), *(id(p) in ids for ids in self._apart)

        for unit in self.units:
            params = params_of[unit.index]
            for k in sorted({key(p) for p in params}):
                members = [p for p in params if key(p) == k]
                layouts.setdefault(unit.index, []).append(
                    FlatBucket.build(members, [names[p] for p in members], self.world_size, k[0]))
        # launch order for reduce-scatters: roughly backward order (last units first), root and persistent last
        ordered = [b for u in reversed(self.units) if not (u.root or u.persistent) for b in layouts[u.index]]
        ordered += [b for u in self.units if u.root or u.persistent for b in layouts[u.index]]
        for index, layout in enumerate(ordered):
            layout.index = index
        self._master = MasterShards(ordered, groups, self.precision.master_dtype, self.env, self.offload, self.ratio,
                                    grad_dtype=self.grad_dtype, low_dtype=self.precision.working_dtype)
        for unit in self.units:
            self._materialise(unit, layouts[unit.index])
        self.buckets = sorted((b for u in self.units for b in u.buckets), key=lambda b: b.index)
        self._bucket_of = {p: b for b in self.buckets for p in b.layout.params}
        self._grad_buffer = []
        self._place(module)  # what no unit holds: metric states, say
        self.comm.broadcast_coalesced([b for b in module.buffers() if not b.is_meta])
        self._launcher = OrderedLauncher([sum(p.requires_grad for p in b.layout.params) for b in self.buckets],
                                         self._launch)
        self._reducer = BucketReducer(self.comm, self.grad_dtype, self.device,
                                      max(b.layout.padded for b in self.buckets))
        if optimizer is not None:
            self._master.retarget(optimizer)
        self._install_hooks()
        for unit in self.units:
            if unit.persistent:
                self._gather(unit)
        self.record_plan()

    def _materialise(self, unit: Unit, layouts: list[FlatBucket]) -> None:
        """Give the unit's parameters their values one whole tensor at a time (``RecordsInit._chunks``), keep this
        rank's range of each in its piece, and turn the parameters into views of the (freed) gather buffer: a rank
        holds its pieces plus one tensor, whatever the unit's size (a 70B decoder layer is 3.4 GB; the whole unit at
        once made fsdp's setup peak on 64 ranks 17 GB)."""
        for layout in layouts:
            lo, hi = layout.piece_range(self.rank)
            master = self._master[layout].zero_()  # the padding stays zero
            for start, chunk in self._chunks(layout.params, layout.offsets):
                a, b = max(lo, start), min(hi, start + chunk.numel())
                if a < b:
                    master[a - lo : b - lo].copy_(chunk[a - start : b - start])
            same = master.dtype == self.precision.working_dtype and master.device == self.device
            shard = master if same else torch.empty(layout.piece, dtype=self.precision.working_dtype,
                                                    device=self.device).copy_(master)
            gathered = torch.empty(layout.padded, dtype=self.precision.working_dtype, device=self.device)
            self._point(layout.params, layout.param_views(gathered))
            resize_storage(gathered, 0)
            unit.buckets.append(ShardedBucket(layout, unit, gathered, shard))

    def _install_hooks(self) -> None:
        hooks = []
        for unit in self.units:
            for mod in unit.modules:
                hooks.append(mod.register_forward_pre_hook(partial(self._pre_forward, unit)))
                hooks.append(mod.register_forward_hook(partial(self._post_forward, unit)))
        on_grad = weakly(self._on_grad)  # a parameter's hook must not keep the strategy (and its module) alive
        self._hooks = hooks + [p.register_post_accumulate_grad_hook(on_grad) for p in self._bucket_of
                               if p.requires_grad]

    # -- gathering -----------------------------------------------------------------------------------
    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        """Start gathering ``unit`` unless it is (being) gathered; unless ``async_op``, wait until it is."""
        if not unit.gathered:
            unit.gathered = True
            for b in unit.buckets:
                resize_storage(b.gathered, b.layout.padded * b.gathered.element_size())
                unit.handles.append(self.comm.all_gather(b.gathered, b.shard, async_op=True))
        if not async_op:
            self._wait(unit)

    def _wait(self, unit: Unit) -> None:
        for handle in unit.handles:
            handle.wait()
        unit.handles.clear()

    def _reshard(self, unit: Unit) -> None:
        if self._finished is unit:
            self._finished = None
        if not unit.gathered or unit.persistent:
            return
        self._wait(unit)
        for b in unit.buckets:
            resize_storage(b.gathered, 0)
        unit.gathered = False

    def _next_in_order(self, phase: str, unit: Unit) -> Unit | None:
        """Follow the order recorded on the first step; on a deviation stop prefetching (once, loudly)."""
        following = self._order.follow(phase, unit.index)
        if self._order.deviated and self.prefetch:
            rank_zero_warn(f"{self.name}: the {phase} order of units changed since the first step; "
                           "prefetching is off from now on (results are unaffected).")
            self.prefetch = False
        return next((u for u in self.units if u.index == following), None) if self.prefetch else None

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast, and the root unit gathered for the step (until the end of backward when training)."""
        self._order.restart("forward")
        for unit in self.units:
            unit.forward_calls = 0
            if unit.root:
                self._gather(unit)
        with self.precision.forward_context(self.device):
            yield
        if not torch.is_grad_enabled():
            for unit in self.units:
                self._reshard(unit)

    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        if _in_backward():  # recomputation under activation checkpointing
            self._gather(unit)
            return
        if unit.forward_calls == 0:
            nxt = self._next_in_order("forward", unit) if torch.is_grad_enabled() else None
            self._free_finished(keep=unit)
            self._gather(unit)
            if nxt is not None:
                self._gather(nxt, async_op=True)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output: object) -> None:
        if _in_backward():  # recomputation: backward frees the unit once its gradients are reduced
            return
        if torch.is_grad_enabled():  # backward gathers the unit again when it reaches these outputs
            on_first_grad(output, partial(self._pre_backward, unit))
        unit.forward_calls += 1
        if unit.forward_calls < len(unit.modules):
            return
        unit.forward_calls = 0
        if self.reshard_after_forward and not torch.is_grad_enabled():
            self._reshard(unit)
        elif self.reshard_after_forward:
            self._free_finished(keep=unit)
            self._finished = unit

    def _free_finished(self, keep: Unit) -> None:
        """Free the unit whose training forward ended last, unless it is ``keep``: the last of a forward stays
        gathered for backward, which would gather it again at once (torchtitan keeps its last block so by hand)."""
        if self._finished is not None and self._finished is not keep:
            self._reshard(self._finished)

    def _pre_backward(self, unit: Unit, grad: Tensor) -> None:
        self._queue_end_backward()
        nxt = self._next_in_order("backward", unit)
        self._gather(unit)
        if nxt is not None:
            self._gather(nxt, async_op=True)

    # -- gradients -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        self.check_plan()
        self._launcher.reset()
        self._end_queued = False
        for unit in self.units:
            unit.pending_grads = sum(p.requires_grad for b in unit.buckets for p in b.layout.params)
            if unit.root:  # a pipeline runs forwards between backwards: the last backward's end freed it
                self._gather(unit)
        self._order.restart("backward")
        yield

    def _queue_end_backward(self) -> None:
        if not self._end_queued:
            Variable._execution_engine.queue_callback(self._end_backward)
            self._end_queued = True

    def _on_grad(self, param: Tensor) -> None:
        self._queue_end_backward()
        bucket = self._bucket_of[param]
        if self._syncing or self.sync_micro_steps:
            self._launcher.ready(bucket.index)
            return
        unit = bucket.unit  # gradients stay whole until the window's last backward,
        unit.pending_grads -= 1  # but the unit's parameters can go once they are all in
        if unit.pending_grads == 0 and not unit.root:
            self._reshard(unit)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        source = self._reducer.fill(bucket.layout)
        self._reducer.reduce(source, self._grad_of(bucket.layout), accumulate=not self._first_micro_step)
        unit = bucket.unit
        unit.reduced_buckets += 1
        if unit.reduced_buckets == len(unit.buckets):  # every gradient of the unit is in: its parameters can go
            unit.reduced_buckets = 0
            if not unit.root:
                self._reshard(unit)

    def _end_backward(self) -> None:
        if self._syncing or self.sync_micro_steps:
            self._launcher.flush()
            self._reducer.finish()
            self._first_micro_step = False
        for unit in self.units:
            self._reshard(unit)
        self._end_queued = False

    def reduce_gradients(self, scale: float | Tensor) -> None:
        self._launcher.flush()  # a window whose last backward ran under no_sync
        self._reducer.finish()
        self._launcher.reset()
        self._first_micro_step = True
        if self.replicate is not None and self.replicate.active and self._grad_buffer:
            self.replicate.all_reduce(self._grad_buffer[0])  # HSDP: the window's shards summed across replicas
        self._scale_local_grads(scale)

    def gradients(self) -> list[Tensor]:
        return list(self._grad_buffer)

    def keep_apart(self, params: Collection[Tensor]) -> None:
        self._apart.append({id(p) for p in params})

    def _buckets_within(self, ids: set[int]) -> list[ShardedBucket]:
        """The buckets holding only parameters in ``ids`` (a bucket holding some of them and others is an error: they
        were not kept apart)."""
        out = []
        for b in self.buckets:
            inside = [id(p) in ids for p in b.layout.params]
            if all(inside):
                out.append(b)
            elif any(inside):
                raise ValueError(f"{self.name}: bucket {b.index} mixes parameters that were to be kept apart with "
                                 "others; call keep_apart before setup.")
        return out

    def gradients_of(self, params: Collection[Tensor]) -> list[Tensor]:
        return [self._grad_of(b.layout) for b in self._buckets_within({id(p) for p in params})]

    def _counted(self, exclude: Collection[Tensor]) -> list[Tensor]:
        if not exclude:
            return self.gradients()
        skip = {b.index for b in self._buckets_within({id(p) for p in exclude})}
        return [self._grad_of(b.layout) for b in self.buckets if b.index not in skip]

    def _grad_of(self, layout: FlatBucket) -> Tensor:
        """The bucket's gradient shard; the flat buffer behind all of them is allocated on first use (not
        during sharded initialisation, whose peak is a shard plus one unit)."""
        if not self._grad_buffer:
            total = sum(b.layout.piece for b in self.buckets)
            self._grad_buffer = [torch.zeros(total, dtype=self.grad_dtype, device=self.device)]
            offset = 0
            for b in self.buckets:
                b.grad = self._grad_buffer[0][offset : offset + b.layout.piece]
                offset += b.layout.piece
        grad = self.buckets[layout.index].grad
        assert grad is not None
        return grad

    # -- step ----------------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        assert self.optimizer is not None
        self._master.step(self.optimizer, self._grad_of, self._take_grad_mult(),
                          low_of=lambda layout: self.buckets[layout.index].shard)
        self._refresh_shards()
        self.sync_buffers()

    def _refresh_shards(self) -> None:
        """Bring updated masters into the compute-dtype shards; re-gather what stays gathered."""
        for b in self.buckets:
            self._master.write_low(b.layout, b.shard)
        for unit in self.units:
            if unit.gathered:
                unit.gathered = False
                self._gather(unit)

    def zero_grad(self) -> None:
        self._grad_mult = 1.0  # a step skipped for overflow never consumed it
        for buffer in self._grad_buffer:
            buffer.zero_()

    # -- inspection and state ------------------------------------------------------------------------
    def _gather_buckets(self, piece_of: Callable[[ShardedBucket], Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for b in self.buckets:
            piece = piece_of(b).to(self.device)
            full = piece.new_empty(b.layout.padded)
            self.comm.all_gather(full, piece.contiguous())
            out |= dict(zip(b.layout.names, b.layout.param_views(full), strict=True))
        return out

    def full_parameters(self) -> dict[str, Tensor]:
        return self._gather_buckets(lambda b: self._master[b.layout])

    def full_gradients(self) -> dict[str, Tensor]:
        grads = self._gather_buckets(lambda b: self._grad_of(b.layout).float())
        return {n: g * self._grad_mult for n, g in grads.items()}

    def state_layout(self) -> st.StateLayout:
        shapes, whole = self._whole_state(skip={n for b in self.buckets for n in b.layout.names})
        model, optimizer = self._master.holders(self.rank, self.optimizer)
        return st.StateLayout(shapes, whole + model, self.optimizer, optimizer, self._group_names)

    def _after_load(self) -> None:
        self._master.adopt_state()
        self._refresh_shards()

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        split = self._master.split(self.optimizer)
        gathered = [b.gathered for b in self.buckets if b.gathered.untyped_storage().nbytes()]
        grads = list(self._grad_buffer) + [p.grad for p in self._bucket_of if p.grad is not None]
        grads += self._reducer.buffers
        device = split["device"]
        return MemoryReport.of({"params": [b.shard for b in self.buckets] + gathered, "grads": grads + device["grads"],
                                "master": device["master"], "optimizer": device["optimizer"],
                                "buffers": list(self.module.buffers())}, split["host"])

    def comms(self) -> list[Comm]:
        return [self.comm] + ([self.replicate] if self.replicate is not None else [])

    def teardown(self) -> None:
        """Nothing to release: the module holds only its shards, and its hooks, which gather a unit for each forward,
        are what keeps it usable (evaluation after ``fit``, a ``forward`` by hand)."""
