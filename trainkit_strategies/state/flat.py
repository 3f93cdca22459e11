"""Flat buffers split into equal pieces across ranks, and in-order launching of their collectives.

Shared by every strategy that communicates gradients or parameters in buckets (DDP, ZeRO-1/2,
ZeRO-3/FSDP): a ``FlatBucket`` lays whole parameters end to end, pads the total to a multiple of
``world_size * ALIGN`` elements, and gives rank ``r`` the ``r``-th equal piece. One reduce-scatter of
the bucket hands every rank the reduced gradients of its piece; one all-gather of the pieces rebuilds the
bucket. ``Segment``s say which parameter elements a piece holds, which is what universal checkpoints store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from trainkit_strategies.communication.comm import Comm, Handle
from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.state.pieces import Segment

ALIGN = 16  # elements: pieces start on 64-byte boundaries for fp32 (32 for bf16)


@dataclass(eq=False)
class FlatBucket:
    """Parameters ``params`` (named ``names``) at ``offsets`` of a flat buffer of ``padded`` elements."""

    params: list[Tensor]
    names: list[str]
    offsets: list[int]
    numel: int
    padded: int
    world_size: int
    group: int = 0  # optimizer param group the bucket belongs to
    index: int = 0  # position in the launch order
    start: int = 0  # where the bucket sits in its group's flat buffer
    shard_start: int = 0  # where this rank's piece sits in its group's flat shard

    @classmethod
    def build(cls, params: Sequence[Tensor], names: Sequence[str], world_size: int, group: int = 0) -> FlatBucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        quantum = world_size * ALIGN
        padded = max(quantum, -(-total // quantum) * quantum)
        return cls(list(params), list(names), offsets, total, padded, world_size, group)

    def param_views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's slice of ``flat`` (this bucket's buffer), shaped like the parameter."""
        return [flat[off : off + p.numel()].view(p.shape) for p, off in zip(self.params, self.offsets, strict=True)]

    @property
    def piece(self) -> int:
        return self.padded // self.world_size

    def piece_range(self, rank: int) -> tuple[int, int]:
        return rank * self.piece, (rank + 1) * self.piece

    def segments(self, rank: int, base: int = 0) -> list[Segment]:
        """The parameter ranges in ``rank``'s piece, with local offsets starting at ``base``."""
        lo, hi = self.piece_range(rank)
        out = []
        for name, p, off in zip(self.names, self.params, self.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append(Segment(name, a - off, b - off, base + a - lo))
        return out


FIRST_BUCKET_BYTES = 2**20
"""The first bucket of a backward closes once it holds this much (torch DDP's first bucket too): the first
gradients start across the wire while the rest of backward runs, instead of waiting for a whole bucket. Over a
1 Gb/s link a 25 MiB first bucket left the link idle for 3/4 of backward (about 20 ms a step on the reference MLP)."""


def first_bucket_bytes(env: Environment) -> int | None:
    """``FIRST_BUCKET_BYTES`` where an early first bucket pays: across a network, or on GPUs (whose collectives run
    beside the computation). None (the first bucket as large as any) where every rank computes on the CPUs of one
    host: a collective in flight there runs on the cores backward computes on, and starting one early delayed
    backward by more than it saved (2 ranks on 2 cores over loopback, the reference MLP of
    ``benchmarks/strategies.py``: 0.91x torch DDP's step with a whole first bucket, 0.97x with a 1 MiB one)."""
    one_host = env.local_world_size in (0, env.world_size)
    on_cpus = not env.host_is_separate  # a CPU device (or a plan of one: trainkit estimate's meta device)
    return None if one_host and on_cpus else FIRST_BUCKET_BYTES


def pack(params: Sequence[Tensor], limit_bytes: int, key: Callable[[Tensor], object] = lambda p: None,
         first_bytes: int | None = None) -> list[list[Tensor]]:
    """Group ``params`` (in the given order) into buckets of at most ``limit_bytes`` (a larger parameter
    gets a bucket of its own); parameters with different ``key`` never share a bucket, and a bucket
    stays open while parameters of other keys are packed, so interleaved groups do not fragment.
    ``first_bytes``: each key's first bucket closes as soon as it holds at least that much (so it is
    small, but never empty of the parameter that crossed the mark)."""
    open_: dict[object, list[Tensor]] = {}
    sizes: dict[object, int] = {}
    closed: list[list[Tensor]] = []
    started: set[object] = set()  # keys whose first bucket has closed
    for p in params:
        k = key(p)
        size = p.numel() * p.element_size()
        first_full = first_bytes is not None and k not in started and sizes.get(k, 0) >= first_bytes
        if k in open_ and (sizes[k] + size > limit_bytes or first_full):
            closed.append(open_.pop(k))
            started.add(k)
        if k not in open_:
            open_[k], sizes[k] = [], 0
        open_[k].append(p)
        sizes[k] += size
    return closed + list(open_.values())


class OrderedLauncher:
    """Starts one collective per bucket as buckets fill, strictly in bucket order.

    Every rank must issue collectives in the same order; backward fills buckets in roughly, not
    exactly, the same order everywhere, so bucket ``i`` is launched only once buckets ``0..i-1`` have
    been. ``flush`` launches whatever is left (parameters without gradients, windows cut short).
    """

    def __init__(self, counts: Sequence[int], launch: Callable[[int], None]) -> None:
        self.counts = list(counts)
        self._launch = launch
        self.pending = list(counts)
        self.launched = [False] * len(counts)
        self.next = 0

    def reset(self) -> None:
        self.pending = list(self.counts)
        self.launched = [False] * len(self.counts)
        self.next = 0

    def ready(self, bucket: int) -> None:
        self.pending[bucket] -= 1
        while self.next < len(self.counts) and self.pending[self.next] == 0:
            self._fire(self.next)
            self.next += 1

    def _fire(self, bucket: int) -> None:
        if not self.launched[bucket]:
            self.launched[bucket] = True
            self._launch(bucket)

    def flush(self) -> None:
        for bucket in range(len(self.counts)):
            self._fire(bucket)
        self.next = len(self.counts)


class Codec(Protocol):
    """A compressed reduce-scatter (``onebit.SignReduceScatter``): launch, then finish once the handle is done."""

    def start(self, comm: Comm, out: Tensor, source: Tensor, key: int) -> tuple[Handle, Callable[[], None]]: ...


class BucketReducer:
    """Reduce-scatters gradient buckets into shards, through reusable bucket buffers.

    ``fill`` moves a complete bucket's gradients out of ``.grad`` (freeing them) into a buffer; ``buffers``
    buffers are reused in turn, so a fill waits only for the reduce-scatter that last used its buffer (ZeRO §5.2's
    "constant buffer"). Two of them, as DeepSpeed's ``overlap_comm``, let backward fill the next bucket and put it
    on the wire while the last one is still there: with one, every bucket would wait for its predecessor's whole
    reduce-scatter (``tests/unit/test_overlap.py``). ``reduce`` writes straight into the shard, or, on an
    accumulation micro-step after the first, beside it and adds at ``finish``.
    """

    def __init__(self, comm: Comm, dtype: torch.dtype, device: torch.device, size: int, buffers: int = 2) -> None:
        self.comm, self.dtype, self.device, self.size = comm, dtype, device, size
        self.depth = buffers
        self.buffers: list[Tensor] = []
        self._turn = 0  # the buffer the next fill uses
        self.codec: Codec | None = None  # set: reduce-scatter through it (compressed) instead
        self.pending: list[tuple[Handle, Callable[[], None] | None, Tensor | None, Tensor,
                                 Callable[[], None] | None]] = []
        self._filled: list[int] = []  # per pending reduction, the buffer it reads (-1: none of ours)
        self._last: int = -1

    def _take(self) -> Tensor:
        """The next buffer in turn, once the reduction that last read it has finished."""
        turn = self._turn
        self._turn = (turn + 1) % self.depth
        if turn in self._filled:
            self.finish(upto=len(self._filled) - self._filled[::-1].index(turn))
        while len(self.buffers) <= turn:
            self.buffers.append(torch.empty(self.size, dtype=self.dtype, device=self.device))
        self._last = turn
        return self.buffers[turn]

    def fill(self, bucket: FlatBucket) -> Tensor:
        source = self._take()[: bucket.padded]
        for p, view in zip(bucket.params, bucket.param_views(source), strict=True):
            if p.grad is None:  # not used in this backward on this rank
                view.zero_()
            else:
                view.copy_(p.grad)
                p.grad = None
        source[bucket.numel :].zero_()
        return source

    def stage(self, source: Tensor) -> Tensor:
        """``source`` (a whole bucket of gradients that stays where it is) copied, converted to this reducer's
        dtype, into a bucket buffer, for a reduction in that dtype."""
        return self._take()[: source.numel()].copy_(source)

    def reduce(self, source: Tensor, shard: Tensor, accumulate: bool,
               on_done: Callable[[], None] | None = None, key: int = 0) -> None:
        """Start reduce-scattering ``source`` into ``shard`` (added to it with ``accumulate``); ``on_done`` runs
        once the result is in ``shard``. ``key`` names the bucket to a ``codec`` that keeps state per bucket."""
        out = torch.empty_like(shard) if accumulate else shard
        after = None
        if self.codec is not None and self.comm.active:
            handle, after = self.codec.start(self.comm, out, source, key)
        else:
            handle = self.comm.reduce_scatter(out, source, async_op=True)
        self.pending.append((handle, after, out if accumulate else None, shard, on_done))
        self._filled.append(self._last)  # -1 where ``source`` was not taken from our buffers (stage 1 in place)
        self._last = -1

    def finish(self, upto: int | None = None) -> None:
        """Wait for the reductions in flight (the first ``upto`` of them), in the order they started."""
        upto = len(self.pending) if upto is None else upto
        for handle, after, reduced, shard, on_done in self.pending[:upto]:
            handle.wait()
            if after is not None:
                after()
            if reduced is not None:
                shard.add_(reduced)
            if on_done is not None:
                on_done()
        del self.pending[:upto], self._filled[:upto]
