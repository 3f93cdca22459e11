"""Collectives with byte accounting: the only module in trainkit that calls torch.distributed ops.

Every call adds its payload to ``Comm.stats``: all_reduce counts the tensor reduced, reduce_scatter the full input,
all_gather the full output, broadcast / send / recv the tensor moved. In the units of the ZeRO paper (§7), an
all-reduce of Ψ elements moves as much as a reduce-scatter plus an all-gather of Ψ, which ``CommStats.volume`` reports
(all_reduce weighted 2, the others 1).

With ``world_size == 1`` the same calls run with communication skipped (all_gather copies, others return at once) and
count nothing, so strategies need no single-process branch.

On gloo, ``reduce_scatter`` and ``all_gather`` (above 4 KB: a smaller one pays one call's latency, not a ring's W-1
rounds) run as rings of point-to-point exchanges written here: gloo's own ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` each take about twice as long as a whole all-reduce of the same buffer (measured: 58 and 55
ms against 27 ms for 8.4M fp32 elements on 2 ranks), which would make every sharded strategy pay four all-reduces'
worth of time for what the ZeRO paper counts as one. A ring moves (W-1)/W of the buffer per rank in W-1 rounds
(Patarasuk & Yuan, 2009). NCCL keeps its native collectives. Each round's exchange travels as messages of at most
``MESSAGE_BYTES`` posted together: one gloo message of many megabytes crosses a network link at about half its rate
(measured on a 1 Gb/s link between two hosts: 16.8 MB as one message 248 ms, as 1 MiB messages 141 ms against the 134
ms the rate allows; ``benchmarks/link.py``), and over loopback the split costs nothing measurable.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainkit_strategies.communication.environment import collectives_on_loopback, elastic_store
from trainkit_strategies.communication.liveness import Heartbeat, Waiter

if TYPE_CHECKING:
    from trainkit_strategies.communication.environment import Environment

MESSAGE_BYTES = 1 << 20  # the most one point-to-point message of a ring round carries (see above)
_TAG_PIECES = 256  # tags per ring collective: a round's messages each get their own
_SMALL = 4096  # bytes: an all-gather this small runs as gloo's own (one call's latency; the rings pay off for large)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_heartbeat: Heartbeat | None = None  # this process's, started with the default process group (liveness.py)
_SLICE = timedelta(seconds=1)  # a gloo wait checks the heartbeat this often: a verdict fails the wait at once
_waiter = Waiter()


def peer_failure() -> str | None:
    """What the heartbeat found wrong with a peer (which rank, and how), once it has; None until then."""
    return _heartbeat.failure if _heartbeat is not None else None


def _abort_communicators(verdict: str) -> None:
    """The heartbeat's verdict: abort every NCCL communicator of the process, so kernels and host waits blocked on
    the dead peer fail now (gloo waits notice the verdict between slices, see ``Comm._wait``)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()


def _destroy_at_exit() -> None:
    if _heartbeat is not None:
        _heartbeat.finish()
    if dist.is_initialized() and peer_failure() is None:  # a frozen peer's collective would hold the teardown
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # A gloo worker thread frees a finished collective's tensors after it has woken the waiting thread;
        # freeing a tensor Python has let go of needs the GIL, and a thread that asks for it once the
        # interpreter is finalizing is ended mid-destructor: "terminate called without an active
        # exception" (SIGABRT). Releasing the GIL for a moment lets those frees finish first.
        time.sleep(0.1)


def _copy_alone(output: Tensor, input: Tensor) -> None:
    """A collective with nobody to talk to: the output is the input. A strategy laid out for more ranks than it
    communicates with (``trainkit estimate`` measures layouts on the meta device) gets the overlapping part."""
    if output.data_ptr() == input.data_ptr() and output.device.type != "meta":
        return
    n = min(output.numel(), input.numel())
    output.view(-1)[:n].copy_(input.reshape(-1)[:n])


def _pieces(t: Tensor) -> tuple[Tensor, ...]:
    """``t`` as messages of at most ``MESSAGE_BYTES`` (none when it is empty)."""
    n = t.numel() * t.element_size()
    return t.reshape(-1).tensor_split(min(_TAG_PIECES, -(-n // MESSAGE_BYTES))) if n else ()


class PeerError(RuntimeError):
    """A collective failed because another rank died, raised, or stopped answering within the timeout."""


class CommDeviceError(RuntimeError):
    """A collective was handed a tensor that does not live on its communicator's device (a local bug, not a peer's)."""


@dataclass
class CommStats:
    """Payload bytes and call counts per collective kind, and the seconds spent inside torch.distributed calls
    (waiting for a collective, or running one that blocks: what a step spends on communication it does not hide)."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_s: float = 0.0

    def volume(self) -> int:
        """Bytes in reduce-scatter/all-gather units: an all-reduce counts twice its payload."""
        return sum(b * (2 if kind == "all_reduce" else 1) for kind, b in self.bytes.items())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.wait_s = 0.0

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


class Handle:
    """An in-flight collective; ``wait()`` blocks until it finished (no-op when it ran synchronously).

    A ring collective is a generator that yields the point-to-point works of each round: the first round is posted
    when the handle is made (so it overlaps with whatever the caller does next), the rest run inside ``wait()``.
    """

    __slots__ = ("_comm", "_p2p", "_rounds", "_work")

    def __init__(self, work: Any = None, comm: Comm | None = None, rounds: Iterator[list[Any]] | None = None,
                 p2p: bool = True) -> None:
        self._work, self._comm, self._rounds, self._p2p = work, comm, rounds, p2p
        if rounds is not None:
            self._work = comm._guard(next, rounds, None)  # type: ignore[union-attr]

    def wait(self) -> None:
        while self._work is not None:
            work, self._work = self._work, None
            assert self._comm is not None
            self._comm._wait(work, self._p2p)
            if self._rounds is not None:
                self._work = self._comm._guard(next, self._rounds, None)


DONE = Handle()  # a handle with nothing to wait for


class Comm:
    """Collectives over one process group (the default one unless ``group`` is given)."""

    def __init__(self, world_size: int = 1, rank: int = 0, group: Any = None, ranks: list[int] | None = None,
                 timeout_s: float = 1800.0, device: torch.device | None = None) -> None:
        self.world_size, self.rank, self.group = world_size, rank, group
        self.ranks = ranks if ranks is not None else list(range(world_size))
        self.timeout_s = timeout_s
        self.device = device if device is not None else torch.device("cpu")  # every tensor handed over lives here
        self.stats = CommStats()
        self.ring = world_size > 1 and dist.get_backend(group) == "gloo"
        self._tag = 0

    @classmethod
    def connect(cls, env: Environment) -> Comm:
        """Join (once per process) the default process group: NCCL for CUDA devices, gloo otherwise."""
        if env.world_size == 1:
            return cls(timeout_s=env.timeout_s, device=env.device)
        if not dist.is_initialized():
            backend = "nccl" if env.device.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {}
            if env.device.type == "cuda":
                kwargs["device_id"] = env.device
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            collectives_on_loopback(env)
            timeout = timedelta(seconds=env.timeout_s)
            store = elastic_store(env, timeout)
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout, **kwargs)
            atexit.register(_destroy_at_exit)  # join gloo/NCCL threads before the interpreter tears down
            global _heartbeat
            if env.peer_timeout_s > 0:
                _heartbeat = Heartbeat(store, env.rank, env.world_size, env.peer_timeout_s, _abort_communicators)
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"A process group already exists with rank {dist.get_rank()} of {dist.get_world_size()}, but this "
                f"run expects rank {env.rank} of {env.world_size}."
            )
        return cls(env.world_size, env.rank, timeout_s=env.timeout_s, device=env.device)

    def subgroup(self, ranks: list[int], fresh: bool = False, control: bool = False) -> Comm:
        """A Comm over ``ranks`` (global ranks). Every rank of the process group must call this with the same list,
        in order (making a group is collective over the whole world), except for a group of one rank, which is made
        by nobody: it is a communicator that does nothing. ``fresh``: a group of its own even when ``ranks`` is the
        whole world (point-to-point traffic on it then never interleaves with another group's between the same
        ranks). ``control``: a gloo group on the host for control-plane data (see ``control``)."""
        device = torch.device("cpu") if control else self.device
        alone = Comm(timeout_s=self.timeout_s, device=device)
        me = self.ranks[self.rank]
        if self.world_size == 1 or len(ranks) == 1:
            return alone
        if list(ranks) == self.ranks and not (fresh or control):
            return Comm(self.world_size, self.rank, self.group, self.ranks, self.timeout_s, device)
        options = {"backend": "gloo"} if control and self.device.type != "cpu" else {}  # on the CPU: gloo already
        group = self._guard(dist.new_group, ranks, timeout=timedelta(seconds=self.timeout_s), **options)
        if me not in ranks:
            return alone
        return Comm(len(ranks), ranks.index(me), group, list(ranks), self.timeout_s, device)

    def control(self) -> Comm:
        """A Comm over the same ranks for control-plane flags (preemption, checkpoint progress): a gloo group of
        its own, so its small all-reduces never wait on a GPU stream nor interleave with the strategy's
        collectives, and its bytes are counted apart from the algorithm's. Collective: every rank calls it."""
        return self.subgroup(self.ranks, control=True)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _count(self, kind: str, tensor: Tensor, *others: Tensor) -> None:
        """Count ``tensor``'s payload under ``kind``, after checking it (and ``others``) lives on this communicator's
        device: NCCL takes only tensors on the rank's GPU, and gloo's leniency must not hide a strategy that
        hands it host memory."""
        for t in (tensor, *others):
            if t.device != self.device:
                why = "NCCL takes only tensors on the rank's GPU" if self.device.type == "cuda" else \
                    "a communicator moves tensors of one device"
                raise CommDeviceError(
                    f"{kind} was handed a tensor on {t.device}, but this communicator works on {self.device} ({why}). "
                    "This is a bug in the strategy that issued it; please report it with the traceback."
                )
        self.stats.bytes[kind] += tensor.numel() * tensor.element_size()
        self.stats.calls[kind] += 1

    def _failed(self, err: BaseException | str, waited_s: float = 0.0) -> PeerError:
        if _heartbeat is not None:  # a wait that failed past half of timeout_s names the rank it waited for
            _heartbeat.waiting(waited_s, self.timeout_s, failed=True)
        verdict = _heartbeat.verdict() if _heartbeat is not None else None
        cause = f"{verdict}." if verdict else ("another rank crashed, was killed, raised an error, or did not answer "
                                              f"within timeout_s={self.timeout_s:g}.")
        return PeerError(f"A collective across {self.world_size} ranks failed: {cause} Original error: {err}")

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as err:
            raise self._failed(err, time.perf_counter() - start) from err
        finally:
            self.stats.wait_s += time.perf_counter() - start

    def _wait(self, work: Any, p2p: bool = True) -> None:
        """Wait for ``work`` (one work, or a list), failing at once on a verdict of the heartbeat. On gloo a
        collective's wait runs in one-second slices with the heartbeat checked between them; a point-to-point wait
        (``p2p``: a ring round, a pipeline's transfer) is never cut short, because gloo closes the connection of one
        that times out: it is handed whole to ``liveness.Waiter``'s thread while this one checks the heartbeat.
        (NCCL's wait does not block the host; the heartbeat aborts its communicators instead.)"""
        works = work if isinstance(work, list) else [work]
        if not self.ring or _heartbeat is None:
            for w in works:
                self._guard(w.wait)
            return
        start, heartbeat = time.perf_counter(), _heartbeat

        def give_up() -> bool:  # a verdict, or timeout_s, which names a rank stuck in its own code (liveness.py)
            return heartbeat.waiting(time.perf_counter() - start, self.timeout_s)

        try:
            if p2p:
                _waiter.wait(works, _SLICE.total_seconds(), give_up)
                return
            for w in works:
                while True:
                    try:
                        w.wait(timeout=_SLICE)
                        break
                    except RuntimeError as err:
                        if give_up() or "timed out" not in str(err).lower():
                            raise
        except (RuntimeError, dist.DistError, TimeoutError) as err:
            raise self._failed(err, time.perf_counter() - start) from err
        finally:
            self.stats.wait_s += time.perf_counter() - start

    def _run(self, fn: Any, *args: Any, async_op: bool = False, **kwargs: Any) -> Handle:
        work = self._guard(fn, *args, group=self.group, async_op=True, **kwargs)
        if async_op:
            return Handle(work, self, p2p=False)
        self._wait(work, p2p=False)
        return DONE

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        if not self.active:
            return DONE
        self._count("all_reduce", tensor)
        return self._run(dist.all_reduce, tensor, op=_OPS[op], async_op=async_op)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        """``output`` (1/N of ``input``) receives this rank's slice of the reduction of ``input``; ``input`` is
        scratch space (its contents are undefined afterwards)."""
        if not self.active:
            _copy_alone(output, input)
            return DONE
        self._count("reduce_scatter", input, output)
        if self.ring and op == "sum":
            return self._drive(self._ring_reduce_scatter(output, input), async_op)
        return self._run(_reduce_scatter, output, input, op=_OPS[op], async_op=async_op)

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool = False) -> Handle:
        """``output`` (N times ``input``) receives every rank's ``input`` in rank order."""
        if not self.active:
            _copy_alone(output, input)
            return DONE
        self._count("all_gather", output, input)
        if self.ring and output.numel() * output.element_size() > _SMALL:
            return self._drive(self._ring_all_gather(output, input), async_op)
        return self._run(_all_gather, output, input, async_op=async_op)

    def _drive(self, rounds: Iterator[list[Any]], async_op: bool) -> Handle:
        handle = Handle(None, self, rounds)
        if not async_op:
            handle.wait()
            return DONE
        return handle

    def _exchange(self, send: Tensor, recv: Tensor, tag: int, distance: int = 1) -> list[Any]:
        """Post a receive from the rank ``distance`` behind and a send to the one ``distance`` ahead (one ring
        round at distance 1), each as messages of at most ``MESSAGE_BYTES`` under tags of their own (a receive is cut
        as its sender cuts the same bytes; empty ones are not posted).

        Receives go first. gloo's TCP transport sends a message only once its receiver has announced the receive,
        and the announcement travels on the connection that carries this rank's own outgoing messages, queued behind
        them: posted after the sends, the announcements would wait behind the whole of this rank's payload whenever
        the peer was ready first, and the two directions of the link would run one after the other (1.55x the
        exchange's time at 1 Gb/s, ``benchmarks/link.py``) instead of at once."""
        ahead = self.ranks[(self.rank + distance) % self.world_size]
        behind = self.ranks[(self.rank - distance) % self.world_size]
        base = (tag % (1 << 22)) * _TAG_PIECES
        ops = [dist.P2POp(dist.irecv, piece, behind, self.group, base + i) for i, piece in enumerate(_pieces(recv))]
        ops += [dist.P2POp(dist.isend, piece, ahead, self.group, base + i) for i, piece in enumerate(_pieces(send))]
        return dist.batch_isend_irecv(ops) if ops else []

    def _ring_reduce_scatter(self, output: Tensor, input: Tensor) -> Iterator[list[Any]]:
        """Round s: send chunk r-s-1 onward, add the incoming partial sum into chunk r-s-2; after W-1
        rounds chunk r holds every rank's contribution."""
        world, rank = self.world_size, self.rank
        chunks = input.view(world, -1)
        incoming = torch.empty_like(chunks[0])
        self._tag += 1
        for step in range(world - 1):
            yield self._exchange(chunks[(rank - step - 1) % world], incoming, self._tag)
            chunks[(rank - step - 2) % world].add_(incoming)
        if output.data_ptr() != chunks[rank].data_ptr():
            output.copy_(chunks[rank].view_as(output))

    def _ring_all_gather(self, output: Tensor, input: Tensor) -> Iterator[list[Any]]:
        """Round s: pass chunk r-s onward and receive chunk r-s-1 in place."""
        world, rank = self.world_size, self.rank
        chunks = output.view(world, -1)
        if chunks[rank].data_ptr() != input.data_ptr():
            chunks[rank].copy_(input.view(-1))
        self._tag += 1
        for step in range(world - 1):
            yield self._exchange(chunks[(rank - step) % world], chunks[(rank - step - 1) % world], self._tag)

    def all_to_all(self, output: Tensor, input: Tensor, async_op: bool = False,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> Handle:
        """Chunk j of ``input`` goes to rank j; ``output``'s chunk i comes from rank i. Chunks are equal (W of them)
        or, with ``input_splits``/``output_splits``, of those sizes along dimension 0 (``all_to_all_single``'s
        uneven form: what each rank sends to every other, and receives from it).

        On gloo it runs as W-1 rounds of paired point-to-point exchanges (round s: send to rank r+s, receive
        from rank r-s), each moving one chunk per rank. Counted: the whole input.
        """
        if not self.active:
            _copy_alone(output, input)
            return DONE
        self._count("all_to_all", input, output)
        if self.ring and input_splits is None:  # (uneven: gloo's own, measured as fast as the rounds or faster)
            sends, recvs = input.view(self.world_size, -1), output.view(self.world_size, -1)
            return self._drive(self._pairwise_all_to_all(list(recvs), list(sends)), async_op)
        return self._run(dist.all_to_all_single, output, input, output_splits, input_splits, async_op=async_op)

    def _pairwise_all_to_all(self, recvs: list[Tensor], sends: list[Tensor]) -> Iterator[list[Any]]:
        world, rank = self.world_size, self.rank
        recvs[rank].copy_(sends[rank])
        self._tag += 1
        for step in range(1, world):
            yield self._exchange(sends[(rank + step) % world], recvs[(rank - step) % world], self._tag, step)

    def broadcast(self, tensor: Tensor, src: int = 0, async_op: bool = False) -> Handle:
        """``src`` is a rank within this group."""
        if not self.active:
            return DONE
        self._count("broadcast", tensor)
        return self._run(dist.broadcast, tensor, src=self.ranks[src], async_op=async_op)

    def broadcast_coalesced(self, tensors: list[Tensor], src: int = 0) -> None:
        """Broadcast ``tensors`` from group rank ``src`` in place, one flattened collective per dtype."""
        self._coalesced(tensors, lambda flat: self.broadcast(flat, src))

    def all_reduce_coalesced(self, tensors: list[Tensor], op: str = "sum") -> None:
        """Reduce ``tensors`` in place, one flattened all-reduce per dtype (counted as ``all_reduce``): the gradients
        an axis leaves whole and sums across its group (tensor parallelism's, expert parallelism's)."""
        self._coalesced(tensors, lambda flat: self.all_reduce(flat, op))

    def _coalesced(self, tensors: list[Tensor], collective: Any) -> None:
        """``collective`` on one flat buffer per dtype of ``tensors``, copied back into them."""
        if not self.active:
            return
        by_dtype: dict[object, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t.detach())
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            collective(flat)
            for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(part.view_as(t))

    def shift(self, send: Tensor, recv: Tensor, ring: list[int] | None = None) -> Handle:
        """One hop of a ring, asynchronously: ``send`` goes to the next rank of the ring and ``recv`` receives the
        previous rank's (the receive and the send posted together, as one batch, as NCCL needs). ``ring``: group
        ranks in ring order, this one among them (default: the whole group), so a ring over some of the group's
        ranks shares its communicator (and its order) with the group's collectives. Counted as a send of ``send``."""
        members = list(range(self.world_size)) if ring is None else ring
        if len(members) == 1:
            recv.copy_(send)
            return DONE
        self._count("send", send)
        self._tag += 1
        at = members.index(self.rank)
        ahead, behind = self.ranks[members[(at + 1) % len(members)]], self.ranks[members[(at - 1) % len(members)]]
        ops = [dist.P2POp(dist.irecv, recv, behind, self.group, self._tag),  # receive first: see ``_exchange``
               dist.P2POp(dist.isend, send, ahead, self.group, self._tag)]
        return Handle(self._guard(dist.batch_isend_irecv, ops), self)

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Handle:
        """Asynchronous point-to-point send to group rank ``dst`` (``tag``: matched by gloo; NCCL matches by order)."""
        self._count("send", tensor)
        return Handle(self._guard(dist.isend, tensor, dst=self.ranks[dst], group=self.group, tag=tag), self)

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Handle:
        """Asynchronous point-to-point receive from group rank ``src``."""
        self._count("recv", tensor)
        return Handle(self._guard(dist.irecv, tensor, src=self.ranks[src], group=self.group, tag=tag), self)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._guard(dist.all_gather_object, out, obj, group=self.group)
        self.stats.calls["all_gather_object"] += 1
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj]
        self._guard(dist.broadcast_object_list, box, src=self.ranks[src], group=self.group)
        self.stats.calls["broadcast_object"] += 1
        return box[0]

    def barrier(self) -> None:
        if self.active:
            self._run(dist.barrier)

    def abort(self, reason: str = "") -> None:
        """Tear the process group down after a failure of this rank (``reason``), telling every peer through the
        heartbeat, so peers blocked on this rank fail fast instead of waiting out the timeout."""
        if self.active and dist.is_initialized():
            if _heartbeat is not None and reason:
                _heartbeat.declare(f"rank {self.ranks[self.rank]} failed ({reason})")
            _destroy_at_exit()
            self.world_size = 1
