"""ZeRO stages 1 and 2, and ZeRO-Offload (Rajbhandari et al., 2020, §5.1-5.2; Ren et al., 2021).

Layout. Per optimizer param group, the parameters are packed into buckets (``FlatBucket``s), each
padded to a multiple of ``world_size * ALIGN`` elements; rank ``r`` owns the ``r``-th equal piece of
every bucket. The group's working parameters live in one flat buffer (the module's parameters become
views into it, in the compute dtype); the rank's pieces, concatenated, form the group's flat *shard*:
fp32 master weights and optimizer state exist only for the shard, one optimizer tensor per piece.
Splitting each bucket evenly (rather than the group buffer once) is what lets one reduce-scatter per
bucket deliver every rank its reduced gradients, and one all-gather per bucket rebuild the parameters.

The two stages differ only in where gradients live and when they are reduced, which is a
``GradientLayout`` (``gradients.py``): ``WholeGradients`` (stage 1) keeps whole gradients and reduce-scatters them
once per optimizer step; ``PartitionedGradients`` (stage 2) reduce-scatters each bucket as backward fills it. The
step: gradients are scaled once (normalisation, loss-scale undo), the optimizer updates the
master pieces, and the updated pieces are all-gathered into the working parameters: Ψ
reduce-scattered plus Ψ all-gathered per step (§7).

Offload: master weights and optimizer state live in host memory and the step runs there (``master.py``,
``host_adam.py``); gradients go to the host, updated parameters come back. ``ratio`` keeps the last ``1 - ratio`` of
each group's shard (by bucket) on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import SelfReducing, optimizer_extras
from trainkit_strategies.data_parallel.gradients import (
    GradientLayout,
    Group,
    OffloadedGradients,
    PartitionedGradients,
    WholeGradients,
)
from trainkit_strategies.data_parallel.onebit import SignReduceScatter
from trainkit_strategies.init.materialise import RecordsInit
from trainkit_strategies.offload.hostcopy import mark
from trainkit_strategies.planning.memory import MemoryReport
from trainkit_strategies.precision import Precision
from trainkit_strategies.state import pieces as st
from trainkit_strategies.state.flat import BucketReducer, FlatBucket, OrderedLauncher, first_bucket_bytes, pack
from trainkit_strategies.state.master import DeferredGradScale, FixedGroups, MasterShards


class ZeroStrategy(RecordsInit, DeferredGradScale, FixedGroups, Strategy):
    """Shard optimizer state (and, by its ``gradient_layout``, gradients) across data-parallel ranks.

    Args:
        bucket_mb: bucket size in MiB for reduce-scatter / all-gather.
        offload: keep master weights and optimizer state in host memory and step them there.
        ratio: with ``offload``, the fraction of each group's optimizer state kept on the host.
        broadcast_buffers: broadcast rank 0's floating-point buffers (e.g. BatchNorm statistics) after
            every step, as ddp does.

    Gradients are reduce-scattered and accumulated in the precision policy's ``grad_dtype`` (``reduce_dtype``,
    default the compute dtype; fp32 under bf16-mixed is DeepSpeed's ``communication_data_type``).
    """

    gradient_layout: ClassVar[type[GradientLayout]] = WholeGradients
    data_axis = "dp_shard"
    offloaded_layout: ClassVar[type[GradientLayout] | None] = None  # the layout under ``offload``, if it differs
    any_reduce_dtype = True

    def __init__(self, bucket_mb: float = 25.0, offload: bool = False, ratio: float = 1.0,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.broadcast_buffers = broadcast_buffers
        if not bucket_mb > 0:
            raise ValueError(f"{self.name} bucket_mb must be positive; got {bucket_mb}.")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in [0, 1]; got {ratio}.")
        self.bucket_mb, self.offload, self.ratio = bucket_mb, offload, ratio
        self.buckets: list[FlatBucket] = []  # every bucket, in launch order
        self.grads: GradientLayout = self._layout()
        self.launcher = OrderedLauncher([], self._launch)
        self.reducer = BucketReducer(self.comm, torch.float32, torch.device("cpu"), 0)
        self.groups: list[Group] = []  # per optimizer param group
        self._bucket_of: dict[Tensor, tuple[FlatBucket, int]] = {}
        self._hooks: list = []
        self._signs: SignReduceScatter | None = None  # a SelfReducing optimizer's 1-bit reduce-scatter
        self._uploaded: Any = None  # event: the last step's parameter copies to the device have been issued

    @property
    def manual_optimization(self) -> bool:  # type: ignore[override]
        """Not under offload, whose host step and gradient partition work for one optimizer's window at a time."""
        return not self.offload

    @property
    def accepts_self_reducing(self) -> bool:  # type: ignore[override]
        """1-bit Adam's compressed phase needs the reduce-scatter on the device (not under offload)."""
        return not self.offload

    def _layout(self) -> GradientLayout:
        return (self.offloaded_layout if self.offload and self.offloaded_layout else self.gradient_layout)(self)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduce-scattered and kept in (the policy's ``reduce_dtype``, default the compute
        dtype)."""
        return self.precision.grad_dtype

    @property
    def syncing(self) -> bool:
        """False on accumulation micro-steps (inside ``no_sync``)."""
        return self._syncing

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        """Build the buckets tensor by tensor from wherever the parameters are (host memory, typically, or the meta
        device: each rebuilt or read whole on the host, ``RecordsInit._chunks``), straight into the group's working
        buffer and the rank's master pieces: the device never holds more than those and 16 MiB, so a model whose
        fp32 weights do not fit on the device (what ZeRO-Offload is for) can start, and one built on meta is
        never whole on the device twice."""
        if optimizer is None:
            super().setup(module, optimizer, precision)
            return
        self._bind(module, optimizer, precision)
        for handle in self._hooks:
            handle.remove()
        names = st.param_names(module)
        # frozen parameters stay whole and untouched, as the optimizer would leave them (grad None)
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if p.requires_grad}
        packed = pack(list(reversed(list(group_of))), int(self.bucket_mb * 2**20), key=lambda p: group_of[p],
                      first_bytes=first_bucket_bytes(self.env))
        self.buckets = [FlatBucket.build(b, [names[p] for p in b], self.world_size, group_of[b[0]]) for b in packed]
        for index, bucket in enumerate(self.buckets):
            bucket.index = index
        working, master = self.precision.working_dtype, self.precision.master_dtype
        self.grads = self._layout()
        self._master = MasterShards(self.buckets, len(optimizer.param_groups), master, self.env, self.offload,
                                    self.ratio, grad_dtype=self.grad_dtype, low_dtype=working,
                                    host_grads=not self._grads_on_device(), threads=self._host_threads())
        self.groups = [self._build_group([b for b in self.buckets if b.group == g])
                        for g in range(len(optimizer.param_groups))]
        bucketed = {p for b in self.buckets for p in b.params}  # those that replaced meta ones included
        self._place(module)  # frozen parameters, buffers, metric states
        self.comm.broadcast_coalesced([p for p in module.parameters() if p not in bucketed] + list(module.buffers()))
        self._bucket_of = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.launcher = OrderedLauncher([len(b.params) for b in self.buckets], self._launch)
        self.reducer = BucketReducer(self.comm, self.grad_dtype, self.device, max(b.padded for b in self.buckets))
        self._master.retarget(optimizer)
        self._arm()
        self._signs = (SignReduceScatter(optimizer.error_feedback, getattr(optimizer, "workspace", None))
                       if isinstance(optimizer, SelfReducing) else None)
        self.record_plan()

    def _arm(self) -> None:
        """The gradient hooks on (after ``setup``, and again at the first backward after a ``teardown``)."""
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._bucket_of]

    def _host_threads(self) -> int | None:
        """Cores an offloaded host step uses (None: torch's intra-op threads)."""
        return None

    def _grads_on_device(self) -> bool:
        """Whether reduced gradients reach the step on the device (every layout but ZeRO-Offload's host partition)."""
        return not isinstance(self.grads, OffloadedGradients)

    def _build_group(self, buckets: list[FlatBucket]) -> Group:
        dtype = self.precision.working_dtype
        group = Group(buckets, torch.zeros(sum(b.padded for b in buckets), dtype=dtype, device=self.device))
        start = 0
        for b in buckets:
            b.start = start
            lo, hi = b.piece_range(self.rank)
            working, master = group.working[start : start + b.padded], self._master[b].zero_()
            for offset, chunk in self._chunks(b.params, b.offsets):  # fp32, rank 0's, a tensor at a time: the
                working[offset : offset + chunk.numel()].copy_(chunk)  # master starts from the fp32 original
                first, end = max(lo, offset), min(hi, offset + chunk.numel())
                if first < end:
                    master[first - lo : end - lo].copy_(chunk[first - offset : end - offset])
            group.views[b.index] = (working, working[lo:hi])
            self._point(b.params, b.param_views(working))
            start += b.padded
        self.grads.attach(group)
        return group

    # -- backward ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        self.check_plan()
        compressing = self._signs is not None and self.optimizer.reduces_gradients  # type: ignore[union-attr]
        self.reducer.codec = self._signs if compressing else None
        self._arm()
        self.launcher.reset()
        self.grads.begin_backward()
        yield

    def _on_grad(self, param: Tensor) -> None:
        bucket, index = self._bucket_of[param]
        self.grads.on_grad(param, bucket, index)

    def _launch(self, index: int) -> None:
        self.grads.launch(self.buckets[index])

    def gradient_landed(self, bucket: FlatBucket, landed: Any) -> None:
        """``bucket``'s reduced gradient is in the host partition once ``landed`` has passed (a copy's event, the
        future of an add, None: now). ZeRO-Offload's layout says so; a strategy that steps during backward starts the
        bucket's step here."""

    def reduce_gradients(self, scale: float | Tensor) -> None:
        self.launcher.flush()  # buckets whose hooks did not all fire, or a window whose reduction was deferred
        self.reducer.finish()
        self.launcher.reset()
        self.grads.end_window()
        self._scale_local_grads(scale)

    def gradients(self) -> list[Tensor]:
        return self.grads.tensors()

    def keep_apart(self, params: Collection[Tensor]) -> None:
        raise ValueError(f"{self.name} keeps every gradient of a param group in one partition, so it cannot hold some "
                         "parameters' gradients apart (to sum a weight shared across pipeline stages with its other "
                         "uses, say): use ddp or fsdp for this composition.")

    # -- step ----------------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        self.step_shards()
        self._gather_working()
        self.sync_buffers()

    def step_shards(self) -> None:
        """Hand each piece its reduced gradient (to the host, in the master dtype) and run the optimizer
        on the master pieces: the part of a step that runs on the host under offload."""
        assert self.optimizer is not None
        self._master.step(self.optimizer, self.grads.piece, self._take_grad_mult(), low_of=self._working_piece)

    def _working_piece(self, bucket: FlatBucket) -> Tensor:
        """This rank's piece of ``bucket`` in the working parameters (what it contributes to the all-gather)."""
        return self.groups[bucket.group].views[bucket.index][1]

    def _gather_working(self) -> None:
        """Write every bucket's updated piece into the working parameters and all-gather them in place."""
        handles = []
        for g in self.groups:
            for b in g.buckets:
                whole, mine = g.views[b.index]
                self._master.write_low(b, mine)
                handles.append(self.comm.all_gather(whole, mine, async_op=True))
        self._uploaded = mark(self.device)  # the host may overwrite what the copies up read once this has passed
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        self._grad_mult = 1.0  # a step skipped for overflow never consumed it
        self.grads.zero()

    # -- inspection and state ------------------------------------------------------------------------
    def _gather_buckets(self, piece_of) -> dict[str, Tensor]:
        """Whole tensors, by parameter name, from each bucket's local piece (collective)."""
        out: dict[str, Tensor] = {}
        for b in self.buckets:
            piece = piece_of(b).to(self.device)
            full = piece.new_empty(b.padded)
            self.comm.all_gather(full, piece.contiguous())
            out |= dict(zip(b.names, b.param_views(full), strict=True))
        return out

    def full_gradients(self) -> dict[str, Tensor]:
        grads = self._gather_buckets(lambda b: self.grads.piece(b).float())
        return {n: g * self._grad_mult for n, g in grads.items()}

    def full_parameters(self) -> dict[str, Tensor]:
        assert self.module is not None
        sharded = self._gather_buckets(lambda b: self._master[b])
        return {n: sharded.get(n, p.detach()) for n, p in self.module.named_parameters()}

    def state_layout(self) -> st.StateLayout:
        shapes, whole = self._whole_state(skip={n for b in self.buckets for n in b.names})
        model, optimizer = self._master.holders(self.rank, self.optimizer)
        return st.StateLayout(shapes, whole + model, self.optimizer, optimizer, self._group_names)

    def _after_load(self) -> None:
        self._master.adopt_state()
        self._gather_working()

    def local_state(self) -> dict[str, Tensor]:
        state = super().local_state()
        if self._signs is not None:
            state |= {f"onebit/bucket{k}": v for k, v in self._signs.errors.items()}
        return state

    def load_local_state(self, state: dict[str, Tensor]) -> None:
        super().load_local_state(state)
        if self._signs is not None:
            self._signs.errors = {int(k[13:]): v.float() for k, v in state.items() if k.startswith("onebit/bucket")}

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        split = self._master.split(self.optimizer)
        held = self.grads.memory()
        grads = held["device"] + self.reducer.buffers
        sharded = set(self._bucket_of)
        return MemoryReport.of(
            {
                "params": [g.working for g in self.groups] + [p for p in self.module.parameters() if p not in sharded],
                "grads": grads + split["device"]["grads"],
                "master": split["device"]["master"],
                "optimizer": split["device"]["optimizer"] + optimizer_extras(self),
                "buffers": list(self.module.buffers()),
            },
            {**split["host"], "grads": held["host"] + split["host"]["grads"]},
        )

    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.grads.close()


class Zero1Strategy(ZeroStrategy):
    """ZeRO stage 1: optimizer state sharded; gradients reduce-scattered once per optimizer step."""

    name = "zero1"
    gradient_layout = WholeGradients


class Zero2Strategy(ZeroStrategy):
    """ZeRO stage 2: optimizer state and gradients sharded; reduce-scatter overlapped with backward."""

    name = "zero2"
    gradient_layout = PartitionedGradients
    offloaded_layout = OffloadedGradients
