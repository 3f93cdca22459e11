"""A network link on a clock for ``SimWorld``'s ranks: gloo's TCP protocol, so overlap is a number, not a timing.

Over loopback a collective's transfer costs about what computing costs, and nothing shows whether it overlapped; across
a slow link a lost overlap costs half the step, but only a benchmark sees it. ``LinkWorld`` runs the ranks of a
``SimWorld`` (threads, real values on the CPU, gloo groups) and carries what they send over a simulated link whose
time is a virtual clock, so what a test reads off it is the same on every run and every machine:

- **The link.** Each direction between two ranks carries one byte per tick; the messages of every connection (one per
  group and pair of ranks, as gloo opens them) queue in order, and connections that share a direction share its
  bytes. A message of no bytes (a notice) arrives as soon as nothing is queued ahead of it.
- **gloo's protocol** (``gloo/transport/tcp/pair.cc``): a point-to-point message is sent only once its receiver has
  announced the receive; the announcement is a notice on the connection back, behind whatever the receiver is
  itself sending. A send posted after the peer's announcement arrived goes out at once; one posted before waits
  for it. A native collective (gloo's own all-reduce, say) moves, once every rank has issued it, its ring's bytes
  on every rank's connection to the next (an all-reduce 2(W-1)/W of the tensor, a reduce-scatter or an all-gather
  (W-1)/W, a broadcast the tensor, the rest nothing).
- **The clock** moves only when every rank waits: on the link, or in ``compute(ticks)``, which stands for work that
  takes time (a test calls it from the hooks of its choice). Anything else a rank does takes no time.

``transfers(rank)`` lists what a rank posted, with when each message started moving and when it arrived;
``busy(src, dst)`` when the direction carried bytes.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.simworld import CPU, Group, RuleViolation, SimWorld, _Aborted, _Collective, _Work

_RING_SHARE = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
               "all_gather": lambda w: (w - 1) / w, "all_to_all": lambda w: (w - 1) / w, "broadcast": lambda w: 1.0}


@dataclass(eq=False)
class Message:
    """What one connection carries: data (``nbytes``) or a notice (none)."""

    nbytes: float
    arrive: Callable[[], None]  # run when its last byte arrives
    left: float = 0.0
    started: float | None = None  # the tick its first byte moved
    arrived: float | None = None

    def __post_init__(self) -> None:
        self.left = self.nbytes


@dataclass(eq=False)
class Posted:
    """One operation a rank posted: a point-to-point send or receive, or its part of a native collective."""

    kind: str  # "send", "recv" or the collective's name
    nbytes: int
    at: float  # the tick it was posted
    group: int
    tag: int = 0
    messages: list[Message] = field(default_factory=list)  # the data that carries it (a notice is not counted)
    done: threading.Event = field(default_factory=threading.Event)
    payload: torch.Tensor | None = None

    @property
    def started(self) -> float | None:
        """When its data first moved (a collective's: the first of its messages)."""
        times = [m.started for m in self.messages if m.started is not None]
        return min(times) if times else None

    @property
    def arrived(self) -> float | None:
        times = [m.arrived for m in self.messages]
        return max(times) if times and None not in times else None  # type: ignore[type-var]


@dataclass
class _Pair:
    """One end's state of a gloo connection (``group``, this rank, the peer): gloo's ``Pair``."""

    announced: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # tag -> receives announced to us
    waiting: dict[int, deque] = field(default_factory=lambda: defaultdict(deque))  # tag -> our sends not yet announced
    receives: dict[int, deque] = field(default_factory=lambda: defaultdict(deque))  # tag -> our receives posted


class LinkWorld(SimWorld):
    """``world_size`` ranks as threads on the CPU, on gloo groups whose traffic crosses a simulated link."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        super().__init__(world_size, timeout_s, device=CPU, backend="gloo")
        self.now = 0.0
        self._queues: dict[tuple[int, int], dict[int, deque[Message]]] = defaultdict(dict)  # (src, dst) -> group ->
        self._pairs: dict[tuple[int, int, int], _Pair] = defaultdict(_Pair)  # (group, rank, peer)
        self._busy: dict[tuple[int, int], list[list[float]]] = defaultdict(list)
        self._blocked: dict[int, Callable[[], bool]] = {}  # rank -> what its thread waits for
        self._done: set[int] = set()
        self._deadlines: list[float] = []
        self._posted: dict[int, list[Posted]] = defaultdict(list)
        self._capture = threading.local()
        self._members: dict[tuple, list[Posted]] = defaultdict(list)  # a native collective's part on each rank

    # -- what tests read -----------------------------------------------------------------------------------------
    def transfers(self, rank: int) -> list[Posted]:
        return list(self._posted[rank])

    def busy(self, src: int, dst: int, start: float, end: float) -> float:
        """The fraction of ticks in [start, end] in which the direction ``src`` -> ``dst`` carried bytes."""
        covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._busy[(src, dst)])
        return covered / (end - start)

    def capture(self) -> list[Posted]:
        """Collect, until ``release()``, what this thread posts (the operations behind one collective call)."""
        self._capture.posted = []
        return self._capture.posted

    def release(self) -> None:
        self._capture.posted = None

    def compute(self, ticks: float) -> None:
        """Work of ``ticks`` on the calling rank: its thread waits until the clock has moved that far."""
        with self._lock:
            deadline = self.now + ticks
            self._deadlines.append(deadline)
        self._wait_for(lambda: self.now >= deadline, f"{ticks} ticks of compute")
        with self._lock:
            self._deadlines.remove(deadline)

    # -- the clock -----------------------------------------------------------------------------------------------
    def _finished(self, rank: int) -> None:
        with self._lock:
            self._done.add(rank)
            self._lock.notify_all()

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        rank = self.rank
        with self._lock:
            self._blocked[rank] = ready
            try:
                while not ready():
                    if self._aborted.is_set():
                        raise _Aborted(f"rank {rank} gave up waiting for {what}: another rank failed")
                    if all(r in self._done or (r in self._blocked and not self._blocked[r]())
                           for r in range(self.world_size)):
                        if not self._advance():
                            raise RuleViolation(f"rank {rank} waits for {what}, every rank waits, and nothing is on "
                                                "the link: a deadlock")
                        self._lock.notify_all()
                    elif not self._lock.wait(timeout=self.timeout_s):
                        raise RuleViolation(f"rank {rank} waited {self.timeout_s} s for {what}: a deadlock")
            finally:
                del self._blocked[rank]
                self._lock.notify_all()

    def _advance(self) -> bool:
        """Move the clock to the next arrival or deadline; False when there is none."""
        if self._settle():
            return True
        rates: dict[tuple[int, int], float] = {}
        ends = [d for d in self._deadlines if d > self.now]
        for direction, queues in self._queues.items():
            heads = [q[0] for q in queues.values() if q]
            if heads:
                rates[direction] = 1.0 / len(heads)
                ends += [self.now + m.left / rates[direction] for m in heads]
        if not ends:
            return False
        until = min(ends)
        for direction, rate in rates.items():
            busy = self._busy[direction]
            if busy and busy[-1][1] == self.now:
                busy[-1][1] = until
            else:
                busy.append([self.now, until])
            for q in self._queues[direction].values():
                if q:
                    q[0].started = self.now if q[0].started is None else q[0].started
                    q[0].left -= (until - self.now) * rate
        self.now = until
        self._settle()
        return True

    def _settle(self) -> bool:
        """Deliver every message at the head of its queue that has no bytes left (notices at once)."""
        delivered = False
        again = True
        while again:
            again = False
            for queues in list(self._queues.values()):
                for q in list(queues.values()):
                    while q and q[0].left <= 1e-9:
                        message = q.popleft()
                        message.started = self.now if message.started is None else message.started
                        message.arrived = self.now
                        message.arrive()
                        delivered = again = True
        return delivered

    def _send(self, src: int, dst: int, group: int, message: Message) -> None:
        self._queues[(src, dst)].setdefault(group, deque()).append(message)
        self._settle()
        self._lock.notify_all()

    def _record(self, posted: Posted) -> None:
        self._posted[self.rank].append(posted)
        capture = getattr(self._capture, "posted", None)
        if capture is not None:
            capture.append(posted)

    # -- point to point: gloo's rendezvous -----------------------------------------------------------------------
    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> _Work:
        group = group or self.default
        self._check_device(group, kind, tensor)
        rank = self.rank
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            posted = Posted(kind, nbytes, self.now, group.index, tag)
            self._record(posted)
            if kind == "send":
                posted.payload = self._clone(tensor)
                pair = self._pairs[(group.index, rank, peer)]
                if pair.announced[tag]:
                    pair.announced[tag] -= 1
                    self._carry(group.index, rank, peer, posted)
                else:
                    pair.waiting[tag].append(posted)
            else:
                self._pairs[(group.index, rank, peer)].receives[tag].append(posted)
                notice = Message(0, lambda: self._announced(group.index, peer, rank, tag))
                self._send(rank, peer, group.index, notice)

        def received() -> None:
            self._wait_for(posted.done.is_set, f"a {kind} of {nbytes} bytes with rank {peer} (tag {tag})")
            if kind == "recv":
                assert posted.payload is not None
                if (posted.payload.shape, posted.payload.dtype) != (tensor.shape, tensor.dtype):
                    raise RuleViolation(f"rank {rank}'s receive (tag {tag}) of {tuple(tensor.shape)} was matched by a "
                                        f"send of {tuple(posted.payload.shape)}")
                tensor.copy_(posted.payload)

        return _Work(received)

    def _announced(self, group: int, rank: int, peer: int, tag: int) -> None:
        """``peer``'s announcement of a receive arrived at ``rank``: send what waits for it, or remember it."""
        pair = self._pairs[(group, rank, peer)]
        if pair.waiting[tag]:
            self._carry(group, rank, peer, pair.waiting[tag].popleft())
        else:
            pair.announced[tag] += 1

    def _carry(self, group: int, src: int, dst: int, send: Posted) -> None:
        """Send ``send``'s data: its receiver is the oldest receive of its tag (gloo matches a tag's in order)."""
        receive = self._pairs[(group, dst, src)].receives[send.tag].popleft()

        def arrive() -> None:
            receive.payload = send.payload
            send.done.set()
            receive.done.set()

        message = Message(send.nbytes, arrive)
        send.messages.append(message)
        receive.messages.append(message)
        self._send(src, dst, group, message)

    # -- native collectives: a ring's bytes on every rank's connection to the next -------------------------------
    def _collective(self, name: str, group: Any, tensors: tuple[torch.Tensor, ...], *args: Any) -> Any:
        resolved = group or self.default
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        with self._lock:  # the sequence number SimWorld gives it next (one thread of a rank issues collectives)
            posted = Posted(name, nbytes, self.now, resolved.index)
            self._record(posted)
            self._members[(resolved.index, self._calls[(self.rank, resolved.index)])].append(posted)
        return super()._collective(name, group, tensors, *args)

    def _deliver(self, slot: _Collective, group: Group, tensors: tuple[torch.Tensor, ...]) -> None:
        members = self._members.pop(slot.key)
        size = len(group.ranks)
        moved = _RING_SHARE.get(slot.name, lambda w: 0.0)(size) * members[0].nbytes
        left = [size]

        def arrive() -> None:
            left[0] -= 1
            if left[0] == 0:
                slot.ready.set()
                for posted in members:
                    posted.done.set()

        if not moved:
            left[0] = 1
            arrive()
            return
        for i, src in enumerate(group.ranks):
            message = Message(moved, arrive)
            for posted in members:
                posted.messages.append(message)
            self._send(src, group.ranks[(i + 1) % size], group.index, message)
