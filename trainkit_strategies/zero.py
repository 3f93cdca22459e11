"""ZeRO stages 1 and 2, and ZeRO-Offload (Rajbhandari et al., 2020, §5.1-5.2; Ren et al., 2021).

Layout. Per optimizer param group, the parameters are packed into buckets (``FlatUnit``s), each padded
to a multiple of ``world_size * ALIGN`` elements; rank ``r`` owns the ``r``-th equal piece of every
bucket. The group's working parameters live in one flat buffer (the module's parameters become views
into it, in the compute dtype); the rank's pieces of it, concatenated, form the group's flat *shard*:
the fp32 master weights and the optimizer state exist only for the shard. Splitting each bucket evenly
(rather than the group buffer once) is what lets one reduce-scatter per bucket deliver every rank its
reduced gradients, and one all-gather per bucket rebuild the working parameters.

Stage 1 keeps whole gradients (``.grad`` views into a flat buffer, as DDP) and reduce-scatters them
once per optimizer step, overlapped with the window's last backward; accumulation micro-steps do not
communicate. Stage 2 reduce-scatters each bucket as soon as backward fills it, on every micro-step, and
keeps only the rank's gradient partition, into which micro-steps accumulate; whole gradients exist
only for buckets in flight. The step: gradients are scaled once (normalisation, loss-scale undo),
the optimizer updates the master shard, and the updated pieces are all-gathered into the working
parameters: Ψ reduce-scattered plus Ψ all-gathered per step (§7).

Offload: master weights and optimizer state live in host memory (pinned with CUDA) and the user's
optimizer steps there with torch's fused CPU kernel; gradients go to the host, updated parameters
come back. ``ratio`` keeps the first ``1 - ratio`` of each group's shard (by bucket) on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.base import Strategy, sharded_norm
from trainkit_strategies.comm import Handle
from trainkit_strategies.flat import FlatUnit, OrderedLauncher, pack
from trainkit_strategies.memory import MemoryReport
from trainkit_strategies.precision import Precision

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@dataclass
class _Group:
    """One optimizer param group's flat buffers. Shard space runs over the group's buckets in order;
    its first ``device_part`` elements keep their master and optimizer state on the device."""

    units: list[FlatUnit]
    working: Tensor  # every bucket, compute dtype
    master_device: Tensor  # shard[:device_part], master dtype
    master_host: Tensor  # shard[device_part:], master dtype, host memory when offloading
    grad: Tensor | None = None  # gradient partition, compute dtype, shard-sized
    full_grad: Tensor | None = None  # stage 1: whole gradients, shaped like ``working``

    @property
    def device_part(self) -> int:
        return self.master_device.numel()

    @property
    def shard(self) -> int:
        return self.master_device.numel() + self.master_host.numel()

    @property
    def masters(self) -> list[Tensor]:
        """The optimizer's params for this group: the non-empty master parts."""
        return [t for t in (self.master_device, self.master_host) if t.numel()]

    def master_piece(self, unit: FlatUnit) -> Tensor:
        if unit.shard_start < self.device_part:
            return self.master_device[unit.shard_start : unit.shard_start + unit.piece]
        return self.master_host[unit.shard_start - self.device_part :][: unit.piece]


class ZeroStrategy(Strategy):
    """Shard optimizer state (stage 1) and gradients (stage 2) across data-parallel ranks.

    Args:
        bucket_mb: bucket size in MiB for reduce-scatter / all-gather.
        offload: keep master weights and optimizer state in host memory and step them there.
        ratio: with ``offload``, the fraction of each group's optimizer state kept on the host.
    """

    stage: ClassVar[int] = 1

    def __init__(self, bucket_mb: float = 25.0, offload: bool = False, ratio: float = 1.0) -> None:
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"{self.name} bucket_mb must be positive; got {bucket_mb}.")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in [0, 1]; got {ratio}.")
        self.bucket_mb, self.offload, self.ratio = bucket_mb, offload, ratio
        self._groups: list[_Group] = []
        self._units: list[FlatUnit] = []  # every bucket, in launch order
        self._unit_of: dict[Tensor, tuple[FlatUnit, int]] = {}
        self._launcher = OrderedLauncher([], self._launch)
        self._pending: list[tuple[FlatUnit, Handle, Tensor | None, Tensor | None]] = []
        self._bucket_buffer: Tensor | None = None
        self._syncing = True
        self._first_micro_step = True
        self._callback_queued = False
        self._hooks: list = []

    # -- setup ---------------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype or self.precision.param_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision.mixed else self.precision.param_dtype

    @property
    def host(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        super().setup(module, optimizer, precision)
        if optimizer is None:
            return
        for handle in self._hooks:
            handle.remove()
        self.comm.broadcast_coalesced([*module.parameters(), *module.buffers()])
        names = st.param_names(module)
        limit = int(self.bucket_mb * 2**20)
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._units = [
            FlatUnit.build(b, [names[p] for p in b], self.world_size, group_of[b[0]])
            for b in pack(list(reversed(list(group_of))), limit, key=lambda p: group_of[p])
        ]
        for index, unit in enumerate(self._units):
            unit.index = index
        self._groups = [self._build_group([u for u in self._units if u.group == g])
                        for g in range(len(optimizer.param_groups))]
        self._unit_of = {p: (u, i) for u in self._units for i, p in enumerate(u.params)}
        self._launcher = OrderedLauncher([len(u.params) for u in self._units], self._launch)
        self._retarget(optimizer)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._unit_of]

    def _build_group(self, units: list[FlatUnit]) -> _Group:
        total = sum(u.piece for u in units)
        on_device = 0 if self.offload else total
        if self.offload:
            for u in units:  # the first (1 - ratio) of the shard, by bucket, stays on the device
                if on_device + u.piece <= (1.0 - self.ratio) * total:
                    on_device += u.piece
        working = torch.zeros(sum(u.padded for u in units), dtype=self.compute_dtype, device=self.device)
        pin = self.offload and torch.cuda.is_available()
        dev = torch.zeros(on_device, dtype=self.master_dtype, device=self.device)
        host = torch.zeros(total - on_device, dtype=self.master_dtype, device=self.host, pin_memory=pin)
        start = shard = 0
        for u in units:
            u.start, u.shard_start = start, shard
            full = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
            for p, off in zip(u.params, u.offsets, strict=True):
                full[off : off + p.numel()] = p.detach().reshape(-1)
            lo, hi = u.piece_range(self.rank)
            target = dev[shard : shard + u.piece] if shard < on_device else host[shard - on_device :][: u.piece]
            target.copy_(full[lo:hi])
            working[start : start + u.padded].copy_(full)
            for p, view in zip(u.params, u.param_views(working[start : start + u.padded]), strict=True):
                p.data, p.grad = view, None
            start, shard = start + u.padded, shard + u.piece
        group = _Group(units, working, dev, host)
        if self.stage == 1:
            group.full_grad = torch.zeros_like(working)
            for u in units:
                for p, view in zip(u.params, u.param_views(group.full_grad[u.start : u.start + u.padded]), strict=True):
                    p.grad = view
        else:
            group.grad = torch.zeros(total, dtype=self.compute_dtype, device=self.device)
        return group

    def _retarget(self, optimizer: Optimizer) -> None:
        """Point every param group at its master shard, keeping the group's hyperparameters."""
        optimizer.state.clear()
        for group, g in zip(optimizer.param_groups, self._groups, strict=True):
            group["params"] = g.masters
            if self.offload:
                if isinstance(optimizer, _FUSED) and "fused" in group:
                    group["fused"], group["foreach"] = True, False
                elif "foreach" in group:
                    group["foreach"] = True

    # -- backward ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1 defers its reduce-scatter to the window's last backward; stage 2 reduces every
        micro-step (its gradient partition is what accumulates)."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

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
        else:
            group = self._groups[unit.group]
            view = group.full_grad[unit.start + unit.offsets[index] :][: param.numel()]
            if param.grad.data_ptr() != view.data_ptr():  # .grad was replaced (e.g. set to None): re-attach
                view.copy_(param.grad.reshape(-1))
                param.grad = view.view_as(param)
            if self._syncing:
                self._launcher.ready(unit.index)

    def _launch(self, index: int) -> None:
        unit = self._units[index]
        group = self._groups[unit.group]
        if self.stage == 1:
            source = group.full_grad[unit.start : unit.start + unit.padded]
            if group.grad is None:
                group.grad = torch.empty(group.shard, dtype=self.compute_dtype, device=self.device)
            out, temp = group.grad[unit.shard_start : unit.shard_start + unit.piece], None
        else:
            source = self._fill_bucket_buffer(unit)
            piece = group.grad[unit.shard_start : unit.shard_start + unit.piece]
            out = piece if self._first_micro_step else torch.empty_like(piece)
            temp = None if self._first_micro_step else out  # reduced here, then added into the partition
        handle = self.comm.reduce_scatter(out, source, async_op=True)
        self._pending.append((unit, handle, source, temp))

    def _fill_bucket_buffer(self, unit: FlatUnit) -> Tensor:
        """Stage 2: move a complete bucket's gradients into the one reusable bucket buffer.

        The buffer is reused bucket after bucket, so the previous bucket's reduce-scatter must finish
        first; it ran while backward produced this bucket's gradients. At rest stage 2 holds the
        gradient partition plus this one buffer (ZeRO paper §5.2, "constant buffer").
        """
        while self._pending:
            self._finish(self._pending.pop(0))
        if self._bucket_buffer is None or self._bucket_buffer.numel() < unit.padded:
            self._bucket_buffer = torch.empty(max(u.padded for u in self._units), dtype=self.compute_dtype,
                                              device=self.device)
        source = self._bucket_buffer[: unit.padded]
        for p, view in zip(unit.params, unit.param_views(source), strict=True):
            if p.grad is None:  # not used in this backward on this rank
                view.zero_()
            else:
                view.copy_(p.grad)
                p.grad = None
        source[unit.numel :].zero_()
        return source

    def _finish(self, entry: tuple[FlatUnit, Handle, Tensor | None, Tensor | None]) -> None:
        unit, handle, _, temp = entry
        handle.wait()
        if temp is not None:
            group = self._groups[unit.group]
            group.grad[unit.shard_start : unit.shard_start + unit.piece].add_(temp)  # type: ignore[index]

    def _end_backward(self) -> None:
        """Stage 2, after every backward: reduce what is left (buckets with unused parameters) and wait."""
        self._launcher.flush()
        while self._pending:
            self._finish(self._pending.pop(0))
        self._first_micro_step = False

    def reduce_gradients(self, scale: float | Tensor) -> None:
        if self.stage == 1:
            self._launcher.flush()
        while self._pending:
            self._finish(self._pending.pop(0))
        self._launcher.reset()
        self._first_micro_step = True
        if not (isinstance(scale, float | int) and scale == 1.0):
            self._scale_local_grads(scale)

    def gradients(self) -> list[Tensor]:
        return [g.grad for g in self._groups if g.grad is not None]

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        return sharded_norm(self.gradients(), norm_type, self.comm, self.device)

    # -- step ----------------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        assert self.optimizer is not None
        for g in self._groups:
            assert g.grad is not None
            for master, grad in ((g.master_device, g.grad[: g.device_part]), (g.master_host, g.grad[g.device_part :])):
                if master.numel():
                    master.grad = grad.to(device=master.device, dtype=master.dtype, non_blocking=True)
        self.optimizer.step()
        for g in self._groups:
            g.master_device.grad = g.master_host.grad = None
        self._gather_working()

    def _gather_working(self) -> None:
        """All-gather every bucket's updated pieces into the working parameters."""
        handles = []
        for g in self._groups:
            for u in g.units:
                piece = g.master_piece(u).to(device=self.device, dtype=self.compute_dtype)
                out = g.working[u.start : u.start + u.padded]
                handles.append(self.comm.all_gather(out, piece, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        for g in self._groups:
            if self.stage == 1:
                assert g.full_grad is not None
                g.full_grad.zero_()
                g.grad = None
            elif g.grad is not None:
                g.grad.zero_()

    # -- inspection and state ------------------------------------------------------------------------
    def full_gradients(self) -> dict[str, Tensor]:
        return self._gather_shards([g.grad for g in self._groups])

    def full_parameters(self) -> dict[str, Tensor]:
        assert self.module is not None
        masters = [torch.cat([g.master_device, g.master_host.to(self.device)]) for g in self._groups]
        sharded = self._gather_shards(masters)
        return {n: sharded.get(n, p.detach()) for n, p in self.module.named_parameters()}

    def _gather_shards(self, shards: list[Tensor | None]) -> dict[str, Tensor]:
        """Whole tensors from per-group shard-space tensors (collective)."""
        out: dict[str, Tensor] = {}
        for g, shard in zip(self._groups, shards, strict=True):
            if shard is None:
                continue
            for u in g.units:
                full = shard.new_empty(u.padded)
                self.comm.all_gather(full, shard[u.shard_start : u.shard_start + u.piece].contiguous())
                for name, p, off in zip(u.names, u.params, u.offsets, strict=True):
                    out[name] = full[off : off + p.numel()].view(p.shape)
        return out

    def state_layout(self) -> st.StateLayout:
        shapes, whole = self._whole_state(skip={n for u in self._units for n in u.names})
        holders = []
        for g in self._groups:
            for master, lo, hi in ((g.master_device, 0, g.device_part), (g.master_host, g.device_part, g.shard)):
                if master.numel():
                    segments = [s for u in g.units if lo <= u.shard_start < hi
                                for s in u.segments(self.rank, u.shard_start - lo)]
                    holders.append(st.Holder(master, tuple(segments), True))
        return st.StateLayout(shapes, whole + holders, self.optimizer, holders, self._group_names)

    def _after_load(self) -> None:
        self._gather_working()

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        sharded = set(self._unit_of)
        on_device = [g.master_device for g in self._groups if g.master_device.numel()]
        on_host = [g.master_host for g in self._groups if g.master_host.numel()]
        state = self.optimizer.state if self.optimizer is not None else {}

        def state_of(masters: list[Tensor]) -> list[Tensor]:
            return [t for m in masters for t in state.get(m, {}).values() if isinstance(t, Tensor)]

        grads = [t for g in self._groups for t in (g.grad, g.full_grad) if t is not None]
        if self._bucket_buffer is not None:
            grads.append(self._bucket_buffer)
        return MemoryReport.of(
            {
                "params": [g.working for g in self._groups]
                + [p for p in self.module.parameters() if p not in sharded],
                "grads": grads,
                "master": on_device,
                "optimizer": state_of(on_device),
                "buffers": list(self.module.buffers()),
            },
            {"master": on_host, "optimizer": state_of(on_host)},
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

    def __init__(self, bucket_mb: float = 25.0, offload: bool = True, ratio: float = 1.0) -> None:
        super().__init__(bucket_mb, offload, ratio)
