"""ZeRO stages 1 and 2, and ZeRO-Offload (Rajbhandari et al., 2020, §5.1-5.2; Ren et al., 2021).

Layout. Per optimizer param group, the parameters are packed into buckets (``FlatUnit``s), each padded
to a multiple of ``world_size * ALIGN`` elements; rank ``r`` owns the ``r``-th equal piece of every
bucket. The group's working parameters live in one flat buffer (the module's parameters become views
into it, in the compute dtype); the rank's pieces, concatenated, form the group's flat *shard*: fp32
master weights and optimizer state exist only for the shard, one optimizer tensor per piece. Splitting
each bucket evenly (rather than the group buffer once) is what lets one reduce-scatter per bucket
deliver every rank its reduced gradients, and one all-gather per bucket rebuild the parameters.

Stage 1 keeps whole gradients (``.grad`` views into a flat buffer, as DDP) and reduce-scatters them
once per optimizer step, overlapped with the window's last backward, in place: a rank's reduced
piece is the piece of the whole-gradient buffer it owns. Accumulation micro-steps do not communicate.
Stage 2 reduce-scatters each bucket as soon as backward fills it, on every micro-step, into the rank's
gradient partition, which is what micro-steps accumulate into; whole gradients exist only for one
bucket at a time. The step: gradients are scaled once (normalisation, loss-scale undo), the optimizer
updates the master pieces, and the updated pieces are all-gathered into the working parameters: Ψ
reduce-scattered plus Ψ all-gathered per step (§7).

Offload: master weights and optimizer state live in host memory (pinned with CUDA) and the user's
optimizer steps there with torch's fused CPU kernel; gradients go to the host, updated parameters
come back. ``ratio`` keeps the first ``1 - ratio`` of each group's shard (by bucket) on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.base import Strategy
from trainkit_strategies.flat import BucketReducer, FlatUnit, OrderedLauncher, pack
from trainkit_strategies.master import DeferredGradScale, MasterShards
from trainkit_strategies.memory import MemoryReport
from trainkit_strategies.precision import Precision


@dataclass
class _Group:
    """One optimizer param group's buckets and flat buffers (shard space runs over its buckets in order)."""

    units: list[FlatUnit]
    working: Tensor  # every bucket, compute dtype
    grad: Tensor | None = None  # stage 2: the gradient partition, compute dtype, shard-sized
    full_grad: Tensor | None = None  # stage 1: whole gradients, laid out like ``working``

    def grad_piece(self, unit: FlatUnit, rank: int) -> Tensor:
        """This rank's reduced gradients for ``unit``."""
        if self.full_grad is not None:
            lo, hi = unit.piece_range(rank)
            return self.full_grad[unit.start + lo : unit.start + hi]
        assert self.grad is not None
        return self.grad[unit.shard_start : unit.shard_start + unit.piece]


class ZeroStrategy(DeferredGradScale, Strategy):
    """Shard optimizer state (stage 1) and gradients (stage 2) across data-parallel ranks.

    Args:
        bucket_mb: bucket size in MiB for reduce-scatter / all-gather.
        offload: keep master weights and optimizer state in host memory and step them there.
        ratio: with ``offload``, the fraction of each group's optimizer state kept on the host.
        broadcast_buffers: broadcast rank 0's floating-point buffers (e.g. BatchNorm statistics) after
            every step, as ddp does.
    """

    stage: ClassVar[int] = 1

    def __init__(self, bucket_mb: float = 25.0, offload: bool = False, ratio: float = 1.0,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.broadcast_buffers = broadcast_buffers
        if not bucket_mb > 0:
            raise ValueError(f"{self.name} bucket_mb must be positive; got {bucket_mb}.")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in [0, 1]; got {ratio}.")
        self.bucket_mb, self.offload, self.ratio = bucket_mb, offload, ratio
        self._groups: list[_Group] = []
        self._units: list[FlatUnit] = []  # every bucket, in launch order
        self._unit_of: dict[Tensor, tuple[FlatUnit, int]] = {}
        self._launcher = OrderedLauncher([], self._launch)
        self._reducer = BucketReducer(self.comm, torch.float32, torch.device("cpu"), 0)
        self._first_micro_step = True
        self._callback_queued = False
        self._hooks: list = []

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        super().setup(module, optimizer, precision)
        if optimizer is None:
            return
        for handle in self._hooks:
            handle.remove()
        self.comm.broadcast_coalesced([*module.parameters(), *module.buffers()])
        names = st.param_names(module)
        # frozen parameters stay whole and untouched, as the optimizer would leave them (grad None)
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if p.requires_grad}
        buckets = pack(list(reversed(list(group_of))), int(self.bucket_mb * 2**20), key=lambda p: group_of[p])
        self._units = [FlatUnit.build(b, [names[p] for p in b], self.world_size, group_of[b[0]]) for b in buckets]
        for index, unit in enumerate(self._units):
            unit.index = index
        working, master = self.precision.working_dtype, self.precision.master_dtype
        converts = master != working or (self.offload and self.device.type != "cpu")
        self._master = MasterShards(self._units, len(optimizer.param_groups), master, self.device,
                                    self.offload, self.ratio, host_grads=converts)
        self._groups = [self._build_group([u for u in self._units if u.group == g])
                        for g in range(len(optimizer.param_groups))]
        self._unit_of = {p: (u, i) for u in self._units for i, p in enumerate(u.params)}
        self._launcher = OrderedLauncher([len(u.params) for u in self._units], self._launch)
        self._reducer = BucketReducer(self.comm, working, self.device, max(u.padded for u in self._units))
        self._master.retarget(optimizer)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._unit_of]

    def _build_group(self, units: list[FlatUnit]) -> _Group:
        dtype = self.precision.working_dtype
        group = _Group(units, torch.zeros(sum(u.padded for u in units), dtype=dtype, device=self.device))
        start = 0
        for u in units:
            u.start = start
            full = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
            for p, view in zip(u.params, u.param_views(full), strict=True):
                view.copy_(p.detach())  # the master starts from the fp32 original, not its rounding
            lo, hi = u.piece_range(self.rank)
            self._master[u].copy_(full[lo:hi])
            working = group.working[start : start + u.padded]
            working.copy_(full)
            for p, view in zip(u.params, u.param_views(working), strict=True):
                p.data, p.grad = view, None
            start += u.padded
        if self.stage == 1:
            group.full_grad = torch.zeros_like(group.working)
            for u in units:
                for p, view in zip(u.params, u.param_views(group.full_grad[u.start : u.start + u.padded]),
                                   strict=True):
                    p.grad = view
        else:
            group.grad = torch.zeros(sum(u.piece for u in units), dtype=dtype, device=self.device)
        return group

    # -- backward: stage 1 reduces at the window's last backward (no_sync defers it); stage 2 reduces
    # every micro-step, since its gradient partition is what accumulates ----------------------------
    def backward(self, loss: Tensor) -> None:
        self._launcher.reset()
        self._callback_queued = False
        loss.backward()

    def _on_grad(self, param: Tensor) -> None:
        unit, index = self._unit_of[param]
        if self.stage == 2:
            if not self._callback_queued:
                Variable._execution_engine.queue_callback(self._end_backward)
                self._callback_queued = True
            self._launcher.ready(unit.index)  # the gradient waits in .grad until its bucket launches
            return
        group = self._groups[unit.group]
        view = group.full_grad[unit.start + unit.offsets[index] :][: param.numel()]  # type: ignore[index]
        if param.grad.data_ptr() != view.data_ptr():  # .grad was replaced (e.g. set to None): re-attach
            view.copy_(param.grad.reshape(-1))
            param.grad = view.view_as(param)
        if self._syncing:
            self._launcher.ready(unit.index)

    def _launch(self, index: int) -> None:
        unit = self._units[index]
        group = self._groups[unit.group]
        if self.stage == 1:  # in place: the rank's piece of the whole-gradient buffer is its shard
            source = group.full_grad[unit.start : unit.start + unit.padded]  # type: ignore[index]
            self._reducer.reduce(source, group.grad_piece(unit, self.rank), accumulate=False)
        else:
            source = self._reducer.fill(unit)
            self._reducer.reduce(source, group.grad_piece(unit, self.rank), accumulate=not self._first_micro_step)

    def _end_backward(self) -> None:
        """Stage 2, after every backward: reduce what is left (buckets with unused parameters) and wait."""
        self._launcher.flush()
        self._reducer.finish()
        self._first_micro_step = False

    def reduce_gradients(self, scale: float | Tensor) -> None:
        self._launcher.flush()  # stage 1: buckets whose hooks did not all fire; stage 2: nothing left
        self._reducer.finish()
        self._launcher.reset()
        self._first_micro_step = True
        self._scale_local_grads(scale)

    def gradients(self) -> list[Tensor]:
        if self.stage == 2:
            return [g.grad for g in self._groups if g.grad is not None]
        return [g.grad_piece(u, self.rank) for g in self._groups for u in g.units]

    # -- step ----------------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        self.step_shards()
        self._gather_working()
        self.sync_buffers()

    def step_shards(self) -> None:
        """Hand each piece its reduced gradient (to the host, in the master dtype) and run the optimizer
        on the master pieces: the part of a step that runs on the host under offload."""
        assert self.optimizer is not None
        self._master.step(self.optimizer, lambda u: self._groups[u.group].grad_piece(u, self.rank),
                          self._take_grad_mult())

    def _gather_working(self) -> None:
        """All-gather every bucket's updated pieces into the working parameters."""
        handles = []
        for g in self._groups:
            for u in g.units:
                piece = self._master[u].to(device=self.device, dtype=self.precision.working_dtype)
                handles.append(self.comm.all_gather(g.working[u.start : u.start + u.padded], piece, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self._grad_mult = 1.0  # a step skipped for overflow never consumed it
        for g in self._groups:
            for buffer in (g.full_grad, g.grad):
                if buffer is not None:
                    buffer.zero_()

    # -- inspection and state ------------------------------------------------------------------------
    def _gather_units(self, piece_of) -> dict[str, Tensor]:
        """Whole tensors, by parameter name, from each unit's local piece (collective)."""
        out: dict[str, Tensor] = {}
        for g in self._groups:
            for u in g.units:
                piece = piece_of(g, u).to(self.device)
                full = piece.new_empty(u.padded)
                self.comm.all_gather(full, piece.contiguous())
                out |= dict(zip(u.names, u.param_views(full), strict=True))
        return out

    def full_gradients(self) -> dict[str, Tensor]:
        grads = self._gather_units(lambda g, u: g.grad_piece(u, self.rank).float())
        return {n: g * self._grad_mult for n, g in grads.items()}

    def full_parameters(self) -> dict[str, Tensor]:
        assert self.module is not None
        sharded = self._gather_units(lambda g, u: self._master[u])
        return {n: sharded.get(n, p.detach()) for n, p in self.module.named_parameters()}

    def state_layout(self) -> st.StateLayout:
        shapes, whole = self._whole_state(skip={n for u in self._units for n in u.names})
        model, optimizer = self._master.holders(self.rank, self.optimizer)
        return st.StateLayout(shapes, whole + model, self.optimizer, optimizer, self._group_names)

    def _after_load(self) -> None:
        self._gather_working()

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        split = self._master.split(self.optimizer)
        grads = [t for g in self._groups for t in (g.grad, g.full_grad) if t is not None]
        if self._reducer.buffer is not None:
            grads.append(self._reducer.buffer)
        sharded = set(self._unit_of)
        return MemoryReport.of(
            {
                "params": [g.working for g in self._groups] + [p for p in self.module.parameters() if p not in sharded],
                "grads": grads + split["device"]["grads"],
                "master": split["device"]["master"],
                "optimizer": split["device"]["optimizer"],
                "buffers": list(self.module.buffers()),
            },
            {k: v for k, v in split["host"].items()},
        )

    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class Zero1Strategy(ZeroStrategy):
    """ZeRO stage 1: optimizer state sharded; gradients reduce-scattered once per optimizer step."""

    name = "zero1"
    stage = 1


class Zero2Strategy(ZeroStrategy):
    """ZeRO stage 2: optimizer state and gradients sharded; reduce-scatter overlapped with backward."""

    name = "zero2"
    stage = 2


class ZeroOffloadStrategy(Zero2Strategy):
    """ZeRO-Offload: stage 2 with master weights and optimizer state on the host (``offload=True``)."""

    name = "zero_offload"

    def __init__(self, bucket_mb: float = 25.0, offload: bool = True, ratio: float = 1.0,
                 broadcast_buffers: bool = True) -> None:
        super().__init__(bucket_mb, offload, ratio, broadcast_buffers)
