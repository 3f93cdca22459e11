"""ZeRO stages 1 and 2, and ZeRO-Offload (Rajbhandari et al., 2020, §5.1-5.2; Ren et al., 2021).

Layout. Per optimizer param group, the parameters are packed into buckets (``FlatBucket``s), each
padded to a multiple of ``world_size * ALIGN`` elements; rank ``r`` owns the ``r``-th equal piece of
every bucket. The group's working parameters live in one flat buffer (the module's parameters become
views into it, in the compute dtype); the rank's pieces, concatenated, form the group's flat *shard*:
fp32 master weights and optimizer state exist only for the shard, one optimizer tensor per piece.
Splitting each bucket evenly (rather than the group buffer once) is what lets one reduce-scatter per
bucket deliver every rank its reduced gradients, and one all-gather per bucket rebuild the parameters.

The two stages differ only in where gradients live and when they are reduced, which is a
``GradientLayout``: ``WholeGradients`` (stage 1) keeps whole gradients and reduce-scatters them once
per optimizer step; ``PartitionedGradients`` (stage 2) reduce-scatters each bucket as backward fills
it. The step: gradients are scaled once (normalisation, loss-scale undo), the optimizer updates the
master pieces, and the updated pieces are all-gathered into the working parameters: Ψ
reduce-scattered plus Ψ all-gathered per step (§7).

Offload: master weights and optimizer state live in host memory (pinned with CUDA) and the user's
optimizer steps there with torch's fused CPU kernel; gradients go to the host, updated parameters
come back. ``ratio`` keeps the first ``1 - ratio`` of each group's shard (by bucket) on the device.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.base import SelfReducing, Strategy, optimizer_extras
from trainkit_strategies.data_parallel.onebit import SignReduceScatter
from trainkit_strategies.flat import FIRST_BUCKET_BYTES, BucketReducer, FlatBucket, OrderedLauncher, pack
from trainkit_strategies.hostcopy import CopyStream, host_buffer, mark
from trainkit_strategies.master import DeferredGradScale, MasterShards, transfer
from trainkit_strategies.memory import MemoryReport
from trainkit_strategies.precision import DTYPE_NAMES, Precision


@dataclass
class _Group:
    """One optimizer param group's buckets and the flat buffer of their working parameters."""

    buckets: list[FlatBucket]
    working: Tensor  # every bucket, compute dtype
    views: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # per bucket: its whole, this rank's piece


class GradientLayout(ABC):
    """Where a ZeRO stage keeps a rank's gradients, and when it reduce-scatters them."""

    reduce_buffers: ClassVar[int] = 1  # bucket buffers the reducer takes in turn (``BucketReducer``)

    def __init__(self, strategy: ZeroStrategy) -> None:
        self.strategy = strategy
        self.buffers: list[Tensor] = []  # one per param group

    @abstractmethod
    def attach(self, group: _Group) -> None:
        """Allocate ``group``'s gradient storage (appended to ``buffers``)."""

    def begin_backward(self) -> None:
        """A backward starts."""

    @abstractmethod
    def on_grad(self, param: Tensor, bucket: FlatBucket, index: int) -> None:
        """``param`` (the ``index``-th of ``bucket``) has its gradient for this backward."""

    @abstractmethod
    def launch(self, bucket: FlatBucket) -> None:
        """Start reduce-scattering ``bucket``'s gradients into this rank's piece."""

    @abstractmethod
    def piece(self, bucket: FlatBucket) -> Tensor:
        """This rank's reduced gradients of ``bucket``."""

    def end_window(self) -> None:
        """The accumulation window's gradients are fully reduced."""

    def memory(self) -> dict[str, list[Tensor]]:
        """What this layout holds, by place ("device", "host"), for memory reports."""
        return {"device": list(self.buffers), "host": []}

    def tensors(self) -> list[Tensor]:
        """The gradient tensors this rank holds for norms and scaling (its pieces, group by group)."""
        return [self.piece(b) for g in self.strategy.groups for b in g.buckets]

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()

    def close(self) -> None:
        """Release what outlives a step (threads)."""


class WholeGradients(GradientLayout):
    """ZeRO stage 1 (§5.1): whole gradients, as ``.grad`` views into one flat buffer per group (as DDP), are
    reduce-scattered once per optimizer step, in place and overlapped with the window's last backward: a
    rank's reduced piece is the piece of the buffer it owns. Accumulation micro-steps do not communicate. With a
    ``reduce_dtype`` other than the compute dtype each bucket is converted into the reducer's buffer and
    reduce-scattered into a shard of that dtype (``reduced``)."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        super().__init__(strategy)
        self.reduced: list[Tensor] = []  # per group, the reduced pieces when they are of another dtype

    @property
    def converting(self) -> bool:
        return self.strategy.grad_dtype != self.strategy.precision.working_dtype

    def attach(self, group: _Group) -> None:
        full = torch.zeros_like(group.working)
        for b in group.buckets:
            for p, view in zip(b.params, b.param_views(full[b.start : b.start + b.padded]), strict=True):
                p.grad = view
        self.buffers.append(full)
        if self.converting:
            self.reduced.append(torch.zeros(sum(b.piece for b in group.buckets), dtype=self.strategy.grad_dtype,
                                            device=full.device))

    def on_grad(self, param: Tensor, bucket: FlatBucket, index: int) -> None:
        full = self.buffers[bucket.group]
        view = full[bucket.start + bucket.offsets[index] :][: param.numel()]
        if param.grad.data_ptr() != view.data_ptr():  # .grad was replaced (e.g. set to None): re-attach
            view.copy_(param.grad.reshape(-1))
            param.grad = view.view_as(param)
        if self.strategy.syncing:
            self.strategy.launcher.ready(bucket.index)

    def launch(self, bucket: FlatBucket) -> None:
        source = self.buffers[bucket.group][bucket.start : bucket.start + bucket.padded]
        if self.converting:
            source = self.strategy.reducer.stage(source)
        self.strategy.reducer.reduce(source, self.piece(bucket), accumulate=False, key=bucket.index)

    def piece(self, bucket: FlatBucket) -> Tensor:
        if self.converting:
            return self.reduced[bucket.group][bucket.shard_start : bucket.shard_start + bucket.piece]
        lo, hi = bucket.piece_range(self.strategy.rank)
        return self.buffers[bucket.group][bucket.start + lo : bucket.start + hi]

    def memory(self) -> dict[str, list[Tensor]]:
        return {"device": list(self.buffers) + list(self.reduced), "host": []}

    def zero(self) -> None:
        super().zero()
        for reduced in self.reduced:
            reduced.zero_()


class PartitionedGradients(GradientLayout):
    """ZeRO stage 2 (§5.2): each bucket is reduce-scattered as soon as backward fills it, on every micro-step,
    into the rank's gradient partition, which is what micro-steps accumulate into; whole gradients exist
    for one bucket at a time (moved out of ``.grad`` into one of the reducer's two buffers, taken in turn, so
    backward fills the next bucket while the last one is still on the wire)."""

    reduce_buffers = 2

    def __init__(self, strategy: ZeroStrategy) -> None:
        super().__init__(strategy)
        self._first_micro_step = True
        self._end_queued = False
        self._views: dict[tuple[int, int], Tensor] = {}  # (buffer, bucket) -> the bucket's piece of that buffer

    def attach(self, group: _Group) -> None:
        self.buffers.append(torch.zeros(sum(b.piece for b in group.buckets), dtype=self.strategy.grad_dtype,
                                        device=group.working.device))

    def begin_backward(self) -> None:
        self._end_queued = False

    def on_grad(self, param: Tensor, bucket: FlatBucket, index: int) -> None:
        if not self._end_queued:
            Variable._execution_engine.queue_callback(self._end_backward)
            self._end_queued = True
        self.strategy.launcher.ready(bucket.index)  # the gradient waits in .grad until its bucket launches

    def launch(self, bucket: FlatBucket) -> None:
        source = self.strategy.reducer.fill(bucket)
        self.strategy.reducer.reduce(source, self.piece(bucket), accumulate=not self._first_micro_step,
                                     key=bucket.index)

    def _end_backward(self) -> None:
        """After every backward: reduce what is left (buckets with unused parameters) and wait."""
        self.strategy.launcher.flush()
        self.strategy.reducer.finish()
        self._first_micro_step = False

    def end_window(self) -> None:
        self._first_micro_step = True

    def piece(self, bucket: FlatBucket) -> Tensor:
        buffer = self.buffers[bucket.group]  # a view made once per buffer (the delayed update swaps two in turn)
        key = (id(buffer), bucket.index)
        if key not in self._views:
            self._views[key] = buffer[bucket.shard_start : bucket.shard_start + bucket.piece]
        return self._views[key]

    def tensors(self) -> list[Tensor]:
        return list(self.buffers)


class OffloadedGradients(PartitionedGradients):
    """ZeRO-Offload's stage 2 (Ren et al., 2021, §4.1): the gradient partition lives in host memory, in the
    compute dtype, so the device holds only gradient buckets in flight.

    Each bucket is reduce-scattered as backward fills it. Where host memory is the device's (a CPU run) the result
    lands in the host partition directly. On a GPU it lands in one of two device scratch pieces, and one bulk
    copy on a side stream moves it, still in the compute dtype, to the page-locked host partition while backward
    goes on with the next buckets. An accumulation micro-step after the first copies into one of two page-locked
    staging pieces instead, and a host thread adds it into the partition once the copy has landed, so backward never
    waits for the bus (only for a staging piece whose previous add is still running). Once a bucket's gradient is
    whole in host memory, or will be once an event or an add has passed, the strategy hears of it
    (``gradient_landed``), and may step it then on another host thread (``submit``), so that adds never queue behind
    steps. Nothing crosses the bus converting dtype, and transfers are one per bucket.

    The first micro-step of a window writes the partition rather than adding to it, so ``zero`` touches no host
    memory: every bucket is written by every window's first backward (or by the flush that follows it).
    """

    reduce_buffers = 1  # the device holds one gradient bucket in flight: offload is for models that barely fit

    def __init__(self, strategy: ZeroStrategy) -> None:
        super().__init__(strategy)
        self._staged = strategy.env.host_is_separate
        self._scratch: list[Tensor] = []  # device pieces the reduce-scatter writes into (staged only)
        self._staging: list[Tensor] = []  # page-locked host pieces of accumulating micro-steps (staged only)
        self._copied: list[Any] = [None, None]  # per slot: the event of its last copy to the host
        self._adding: list[Future | None] = [None, None]  # per slot: the host add of its last staged copy
        self._slot = 0
        self._copies: CopyStream | None = None
        self._adder: ThreadPoolExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None

    def attach(self, group: _Group) -> None:
        env, dtype = self.strategy.env, self.strategy.grad_dtype
        self.buffers.append(host_buffer(sum(b.piece for b in group.buckets), dtype, env, pinned=True))
        if self._staged and not self._scratch:
            largest = max(b.piece for b in self.strategy.buckets)
            self._scratch = [torch.empty(largest, dtype=dtype, device=env.device) for _ in range(2)]
            self._staging = [host_buffer(largest, dtype, env, pinned=True) for _ in range(2)]
            self._copies = CopyStream(env.device)
            self._adder = ThreadPoolExecutor(1, thread_name_prefix="trainkit-offload-accumulate")

    def submit(self, fn: Any, *args: Any) -> Future:
        """Run ``fn(*args)`` on the host step's thread, after everything submitted to it before."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="trainkit-offload-host")
        return self._worker.submit(fn, *args)

    def launch(self, bucket: FlatBucket) -> None:
        strategy = self.strategy
        source = strategy.reducer.fill(bucket)
        accumulate = not self._first_micro_step
        if not self._staged:
            strategy.reducer.reduce(source, self.piece(bucket), accumulate=accumulate,
                                    on_done=lambda: strategy.gradient_landed(bucket, None))
            return
        slot, self._slot = self._slot, 1 - self._slot
        CopyStream.wait(self._copied[slot])  # the scratch piece's previous copy to the host has read it
        scratch = self._scratch[slot][: bucket.piece]
        strategy.reducer.reduce(source, scratch, accumulate=False,
                                on_done=lambda: self._to_host(bucket, scratch, slot, accumulate))

    def _to_host(self, bucket: FlatBucket, scratch: Tensor, slot: int, accumulate: bool) -> None:
        assert self._copies is not None and self._adder is not None
        pending = self._adding[slot]
        if accumulate and pending is not None:
            pending.result()  # the staging piece's previous add has read it
        with self._copies.side():
            target = self._staging[slot][: bucket.piece] if accumulate else self.piece(bucket)
            transfer(target, scratch)
            self._copied[slot] = landed = self._copies.mark()
        if accumulate:
            self._adding[slot] = landed = self._adder.submit(self._add, landed, self.piece(bucket), target)
        self.strategy.gradient_landed(bucket, landed)

    @staticmethod
    def _add(landed: Any, piece: Tensor, staged: Tensor) -> None:
        CopyStream.synchronize(landed)
        piece.add_(staged)

    def end_window(self) -> None:
        super().end_window()
        for pending in self._adding:  # the host reads the partition next: every copy and add has landed
            if pending is not None:
                pending.result()
        for event in self._copied:
            CopyStream.synchronize(event)
        self._adding = [None, None]

    def zero(self) -> None:
        """Nothing: the next window's first micro-step overwrites the partition."""

    def close(self) -> None:
        for pool in (self._adder, self._worker):
            if pool is not None:
                pool.shutdown()
        self._adder = self._worker = None

    def memory(self) -> dict[str, list[Tensor]]:
        return {"device": list(self._scratch), "host": list(self.buffers) + list(self._staging)}


class ZeroStrategy(DeferredGradScale, Strategy):
    """Shard optimizer state (and, by its ``gradient_layout``, gradients) across data-parallel ranks.

    Args:
        bucket_mb: bucket size in MiB for reduce-scatter / all-gather.
        offload: keep master weights and optimizer state in host memory and step them there.
        ratio: with ``offload``, the fraction of each group's optimizer state kept on the host.
        broadcast_buffers: broadcast rank 0's floating-point buffers (e.g. BatchNorm statistics) after
            every step, as ddp does.
        reduce_dtype: dtype gradients are reduce-scattered and accumulated in ("fp32", "bf16", "fp16"); default:
            the compute dtype. "fp32" under bf16-mixed sums the ranks' gradients in fp32 (as DeepSpeed's
            ``communication_data_type``), at twice the bytes.
    """

    gradient_layout: ClassVar[type[GradientLayout]] = WholeGradients
    offloaded_layout: ClassVar[type[GradientLayout] | None] = None  # the layout under ``offload``, if it differs

    def __init__(self, bucket_mb: float = 25.0, offload: bool = False, ratio: float = 1.0,
                 broadcast_buffers: bool = True, reduce_dtype: str | None = None) -> None:
        super().__init__()
        self.broadcast_buffers = broadcast_buffers
        if not bucket_mb > 0:
            raise ValueError(f"{self.name} bucket_mb must be positive; got {bucket_mb}.")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in [0, 1]; got {ratio}.")
        if reduce_dtype is not None and reduce_dtype not in DTYPE_NAMES:
            raise ValueError(f"{self.name} reduce_dtype must be one of {sorted(DTYPE_NAMES)}; got {reduce_dtype!r}.")
        self.bucket_mb, self.offload, self.ratio, self.reduce_dtype = bucket_mb, offload, ratio, reduce_dtype
        self.buckets: list[FlatBucket] = []  # every bucket, in launch order
        self.grads: GradientLayout = self._layout()
        self.launcher = OrderedLauncher([], self._launch)
        self.reducer = BucketReducer(self.comm, torch.float32, torch.device("cpu"), 0)
        self.groups: list[_Group] = []  # per optimizer param group
        self._bucket_of: dict[Tensor, tuple[FlatBucket, int]] = {}
        self._hooks: list = []
        self._signs: SignReduceScatter | None = None  # a SelfReducing optimizer's 1-bit reduce-scatter
        self._uploaded: Any = None  # event: the last step's parameter copies to the device have been issued

    @property
    def accepts_self_reducing(self) -> bool:  # type: ignore[override]
        """1-bit Adam's compressed phase needs the reduce-scatter on the device (not under offload)."""
        return not self.offload

    def _layout(self) -> GradientLayout:
        return (self.offloaded_layout if self.offload and self.offloaded_layout else self.gradient_layout)(self)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduce-scattered and kept in (``reduce_dtype``, default the compute dtype)."""
        return DTYPE_NAMES[self.reduce_dtype] if self.reduce_dtype else self.precision.working_dtype

    @property
    def syncing(self) -> bool:
        """False on accumulation micro-steps (inside ``no_sync``)."""
        return self._syncing

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        """Build the buckets bucket by bucket from wherever the parameters are (host memory, typically): the device
        never holds more than the compute-dtype working parameters and one fp32 bucket, so a model whose fp32
        weights do not fit on the device (what ZeRO-Offload is for) can start."""
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
                      first_bytes=FIRST_BUCKET_BYTES)
        self.buckets = [FlatBucket.build(b, [names[p] for p in b], self.world_size, group_of[b[0]]) for b in packed]
        for index, bucket in enumerate(self.buckets):
            bucket.index = index
        working, master = self.precision.working_dtype, self.precision.master_dtype
        self.grads = self._layout()
        self._master = MasterShards(self.buckets, len(optimizer.param_groups), master, self.env, self.offload,
                                    self.ratio, grad_dtype=self.grad_dtype, low_dtype=working,
                                    host_grads=not self._grads_on_device())
        self.groups = [self._build_group([b for b in self.buckets if b.group == g])
                        for g in range(len(optimizer.param_groups))]
        bucketed = set(group_of)
        self._place(module)  # frozen parameters, buffers, metric states
        self.comm.broadcast_coalesced([p for p in module.parameters() if p not in bucketed] + list(module.buffers()))
        self._bucket_of = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.launcher = OrderedLauncher([len(b.params) for b in self.buckets], self._launch)
        self.reducer = BucketReducer(self.comm, self.grad_dtype, self.device, max(b.padded for b in self.buckets),
                                     buffers=self.grads.reduce_buffers)
        self._master.retarget(optimizer)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._bucket_of]
        self._signs = (SignReduceScatter(optimizer.error_feedback, getattr(optimizer, "workspace", None))
                       if isinstance(optimizer, SelfReducing) else None)

    def _grads_on_device(self) -> bool:
        """Whether reduced gradients reach the step on the device (every layout but ZeRO-Offload's host partition)."""
        return not isinstance(self.grads, OffloadedGradients)

    def _build_group(self, buckets: list[FlatBucket]) -> _Group:
        dtype = self.precision.working_dtype
        group = _Group(buckets, torch.zeros(sum(b.padded for b in buckets), dtype=dtype, device=self.device))
        start = 0
        for b in buckets:
            b.start = start
            full = b.flat_values(self.device)  # the master starts from the fp32 original, not its rounding
            self.comm.broadcast(full, src=0)  # every rank starts from rank 0's values
            lo, hi = b.piece_range(self.rank)
            self._master[b].copy_(full[lo:hi])
            working = group.working[start : start + b.padded]
            working.copy_(full)
            group.views[b.index] = (working, working[lo:hi])
            for p, view in zip(b.params, b.param_views(working), strict=True):
                p.data, p.grad = view, None
            start += b.padded
        self.grads.attach(group)
        return group

    # -- backward ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        compressing = self._signs is not None and self.optimizer.reduces_gradients  # type: ignore[union-attr]
        self.reducer.codec = self._signs if compressing else None
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
