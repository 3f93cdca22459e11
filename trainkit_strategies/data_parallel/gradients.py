"""Where a ZeRO stage keeps a rank's gradients and when it reduce-scatters them: one ``GradientLayout`` per stage.

``WholeGradients`` is stage 1 (Rajbhandari et al., 2020, §5.1): whole gradients, reduce-scattered once per optimizer
step. ``PartitionedGradients`` is stage 2 (§5.2): each bucket reduce-scattered into the rank's partition as backward
fills it. ``OffloadedGradients`` is ZeRO-Offload's stage 2 (Ren et al., 2021, §4.1): the partition in host memory.
``ZeroStrategy`` (``zero.py``) holds one of them and asks it where a bucket's reduced gradients are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd import Variable

from trainkit_strategies.offload.hostcopy import CopyStream, host_buffer
from trainkit_strategies.state.flat import FlatBucket
from trainkit_strategies.state.master import transfer

if TYPE_CHECKING:
    from trainkit_strategies.data_parallel.zero import ZeroStrategy


@dataclass
class Group:
    """One optimizer param group's buckets and the flat buffer of their working parameters."""

    buckets: list[FlatBucket]
    working: Tensor  # every bucket, compute dtype
    views: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # per bucket: its whole, this rank's piece


class GradientLayout(ABC):
    """Where a ZeRO stage keeps a rank's gradients, and when it reduce-scatters them."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self.strategy = strategy
        self.buffers: list[Tensor] = []  # one per param group

    @abstractmethod
    def attach(self, group: Group) -> None:
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

    def attach(self, group: Group) -> None:
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

    def __init__(self, strategy: ZeroStrategy) -> None:
        super().__init__(strategy)
        self._first_micro_step = True
        self._end_queued = False
        self._views: dict[tuple[int, int], Tensor] = {}  # (buffer, bucket) -> the bucket's piece of that buffer

    def attach(self, group: Group) -> None:
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

    def attach(self, group: Group) -> None:
        env, dtype = self.strategy.env, self.strategy.grad_dtype
        self.buffers.append(host_buffer(sum(b.piece for b in group.buckets), dtype, env, pinned=True))
        if self._staged and not self._scratch:
            largest = max(b.piece for b in self.strategy.buckets)
            self._scratch = [torch.empty(largest, dtype=dtype, device=env.device) for _ in range(2)]
            self._staging = [host_buffer(largest, dtype, env, pinned=True) for _ in range(2)]
            self._copies = CopyStream(env.device)

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
        assert self._copies is not None
        pending = self._adding[slot]
        if accumulate and pending is not None:
            pending.result()  # the staging piece's previous add has read it
        with self._copies.side():
            target = self._staging[slot][: bucket.piece] if accumulate else self.piece(bucket)
            transfer(target, scratch)
            self._copied[slot] = landed = self._copies.mark()
        if accumulate:
            if self._adder is None:  # made on first use (again after close)
                self._adder = ThreadPoolExecutor(1, thread_name_prefix="trainkit-offload-accumulate")
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
