"""Peers that stop answering, noticed within seconds whatever the backend.

gloo notices a dead peer by itself: its TCP connection closes and the collective fails. NCCL does not: when a peer
dies inside the NCCL kernels, is killed (the OOM killer, say) or freezes, the survivors spin in their kernels, or on
the host waiting for them (``.item()``, a CUDA synchronisation), until the process group's timeout (30 minutes by
default). Every rank therefore runs a ``Heartbeat`` beside training: a daemon thread that, every second, bumps a
counter under its rank in the rendezvous store and reads the counter of its neighbour on a ring (rank + 1) and a
shared verdict key. A neighbour whose counter has not moved for ``dead_after_s`` is declared dead by its watcher,
which writes the verdict; a rank that fails writes it itself (``Comm.abort``); a store that stops answering means
its host, rank 0, is gone. Whoever reads a verdict records it and aborts every NCCL communicator of the process, so
blocked kernels and the host waits behind them fail at once, and the error names the peer. Each rank reads two keys
and writes one per second, whatever the world size.

A rank stuck in its own code (a ``training_step`` that sleeps or loops forever, a dataloader that hangs) beats on,
so it is never declared dead; its peers wait in their next collective. So each beat also carries what the rank is
doing: the phase its training thread last entered (``Activity``: written by the loops and the hook dispatch, one
attribute write a phase, no collective), the step, how long it has been there, and whether it is waiting in a
collective. A rank whose wait passes half of ``timeout_s`` (at most ``WARN_AFTER_S``) reads every rank's last beat
(two reads of the store, about twice per half of ``timeout_s`` at most, not every second) and warns, naming the rank
it waits for: of the ranks not waiting, the one furthest behind (lowest step, then longest in its phase), once it has
been in its phase as long. At ``timeout_s`` it writes that as the verdict, so every rank's error names the stuck
rank, its step and its phase; the stuck rank, which no collective will reach again, prints the verdict and exits.
Nothing fails that did not fail before: a wait ends at ``timeout_s`` as it always did, now with a name.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_VERDICT = "verdict"
_STUCK = "stuck"  # the rank a verdict says the others gave up waiting for
WARN_AFTER_S = 60.0  # a wait this long (or half of timeout_s, when that is sooner) names the rank it waits for
_WAITING_S = 2.5  # a wait reports itself every second: one that did within this is still waiting
_STUCK_GRACE_S = 2.0  # a stuck rank's main thread gets this long to leave on its own before the process ends


class Activity:
    """What this process's training thread is doing, for the heartbeat to tell the other ranks.

    The loops and the hook dispatch call ``enter`` as each phase begins (a dataloader, ``training_step``, a
    callback's hook, backward, the optimizer step). ``now`` is made anew each time, so the heartbeat, which compares
    it by identity, tells a phase that lasts from one entered again. About 50 ns a phase: no clock is read, no
    collective or host synchronisation is made; the heartbeat's thread times the phases at its beats.
    """

    __slots__ = ("now", "step")

    def __init__(self) -> None:
        self.now: tuple[str, int] | None = None  # (phase, step); None: outside trainkit's loops
        self.step = 0

    def enter(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.now = (phase, self.step)


activity = Activity()  # this process's: one training thread per process


@dataclass(frozen=True)
class Peer:
    """What one rank's last beat said about it."""

    rank: int
    waiting: bool  # in a collective, for more than a second
    age_s: float  # seconds in ``phase``, as its heartbeat measured them
    step: int
    phase: str | None

    def doing(self) -> str:
        where = (f"in {self.phase} at step {self.step}" if self.phase is not None
                 else "outside trainkit's loops (setting up, tearing down, or in the script's own code)")
        return f"rank {self.rank} has been {where} for {self.age_s:.0f} s"

    @classmethod
    def parse(cls, rank: int, value: bytes) -> Peer | None:
        """A beat's value (``beat()`` writes it); None for a rank that finished."""
        try:
            _, waiting, age, step, phase = value.decode().split(" ", 4)
            return cls(rank, waiting == "1", float(age), int(step), phase or None)
        except ValueError:  # "done": it finished its run
            return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _exit_stuck(message: str) -> None:
    """The others gave up waiting for this rank, whose main thread is still in its own code: no collective will
    reach them again, and rank 0 of a run it launched would never exit, so print why and end the process."""
    _say(message)
    os._exit(1)


class Heartbeat:
    """Liveness of the ranks of one run, through ``store`` (shared by every rank).

    Args:
        store: the run's rendezvous store (keys are kept under ``trainkit/heartbeat/``).
        rank, world_size: this rank and the number of ranks.
        dead_after_s: a neighbour silent this long is declared dead.
        on_failure: called once, from the heartbeat thread, with the verdict (it aborts the communicators).
        interval_s: seconds between beats.
        clock: the clock silences are measured on; start: run the beats on a thread of their own (a test may
            instead call ``beat()`` itself, on a clock it moves).
        doing: what this rank's training thread is doing (this process's ``activity``; a test gives each rank its own).
        say: where a warning goes (stderr); on_stuck: what ends this process when the others gave up waiting for it.
    """

    def __init__(self, store: Any, rank: int, world_size: int, dead_after_s: float,
                 on_failure: Callable[[str], None], interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, start: bool = True, doing: Activity = activity,
                 say: Callable[[str], None] = _say, on_stuck: Callable[[str], None] = _exit_stuck) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore("trainkit/heartbeat", store)
        self.rank, self.world_size, self.dead_after_s = rank, world_size, dead_after_s
        self.interval_s = min(interval_s, dead_after_s / 4)
        self.failure: str | None = None
        self._on_failure = on_failure
        self._clock = clock
        self._neighbour = (rank + 1) % world_size
        self._beats, self._seen, self._changed = 0, None, clock()  # the neighbour's counter, and when it moved
        self.doing, self._say, self._on_stuck = doing, say, on_stuck
        self._phase, self._since = doing.now, clock()  # this rank's phase as last beaten, and when it was first seen
        self._waited_at, self._waiting_in = -float("inf"), None  # this rank's last report of a wait, and its phase
        self._warned: tuple | None = None  # the stuck rank (and its phase and step) last warned about
        self._waited_s, self._look_at = 0.0, 0.0  # this wait's seconds when last reported, and when to read the beats
        self.blamed = False  # the verdict names this rank as the one the others gave up waiting for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainkit-heartbeat", daemon=True)
        if start:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self.beat():
            pass
        if self.blamed and not self._stop.wait(_STUCK_GRACE_S):  # its main thread did not leave on its own
            self._on_stuck(f"trainkit: error (rank {self.rank}): {self.failure}. The other ranks have stopped, so this "
                           "rank stops too.")

    def beat(self) -> bool:
        """One beat: bump this rank's counter, read the verdict and the neighbour's counter. Returns False once the
        run has failed (a verdict read or declared here) or the store stopped answering: no more beats."""
        neighbour, now = self._neighbour, self._clock()
        phase = self.doing.now
        if phase is not self._phase:
            self._phase, self._since = phase, now
        waiting = phase is self._waiting_in and now - self._waited_at < _WAITING_S
        name, step = phase if phase is not None else ("", self.doing.step)
        try:
            self._beats += 1
            self.store.set(f"beat/{self.rank}", f"{self._beats} {waiting:d} {now - self._since:.1f} {step} {name}")
            if self.store.check([_VERDICT]):
                self.blamed = self.store.check([_STUCK]) and self.store.get(_STUCK) == str(self.rank).encode()
                self._fail(self.store.get(_VERDICT).decode())
                return False
            value = self.store.get(f"beat/{neighbour}") if self.store.check([f"beat/{neighbour}"]) else None
        except Exception as err:  # the store's host is gone (or unreachable): rank 0 died
            if not self._stop.is_set():
                self._fail(f"the rendezvous store stopped answering ({type(err).__name__}): rank 0, which "
                           "hosts it, died or its machine is unreachable")
            return False
        if value == b"done":  # it finished its run
            return True
        if value != self._seen:
            self._seen, self._changed = value, now
        elif self._seen is not None and now - self._changed > self.dead_after_s:
            self.declare(f"rank {neighbour} stopped answering: no heartbeat for {now - self._changed:.0f} s (it "
                         "died, was killed, or froze)")
            return False
        return True

    def waiting(self, waited_s: float, timeout_s: float, failed: bool = False) -> bool:
        """This rank has waited ``waited_s`` in a collective (called about every second of a wait past its first, by
        the thread that waits, and once more with ``failed`` when the wait failed by itself: gloo's own timeout counts
        from when the collective was posted, a little before its wait began). Returns whether to stop waiting: a
        verdict arrived, or ``timeout_s`` passed; a wait that ends so, or fails after half of it, writes the verdict
        naming the rank the others wait for, when one is found (see the module docstring). Before that, when the wait
        and that rank's phase both pass half of ``timeout_s`` (at most ``WARN_AFTER_S``), the lowest waiting rank
        warns, once for each phase a rank is stuck in."""
        self._waited_at, self._waiting_in = self._clock(), self.doing.now
        if self.failure is not None:
            return True
        warn_s = min(WARN_AFTER_S, timeout_s / 2)
        if waited_s < self._waited_s:  # another wait
            self._look_at = 0.0
        self._waited_s, ends = waited_s, failed or waited_s > timeout_s
        if waited_s < max(warn_s, self._look_at if not ends else 0.0):
            return failed
        peers = self.peers()
        behind = min((p for p in peers if not p.waiting), key=lambda p: (p.step, -p.age_s), default=None)
        self._look_at = waited_s + (warn_s if behind is None else max(1.0, warn_s - behind.age_s))
        if behind is None:
            return ends
        if ends:
            with contextlib.suppress(Exception):
                if self.store.check([_VERDICT]):  # a peer's came first (one that raised, say)
                    self._fail(self.store.get(_VERDICT).decode())
                    return True
                self.store.set(_STUCK, str(behind.rank))
            self.declare(f"{behind.doing()} while the other ranks waited for it (timeout_s={timeout_s:g}): look "
                         "there for a hang or a deadlock, or raise timeout_s (--trainer.timeout_s) if it is that slow")
            return True
        key = (behind.rank, behind.phase, behind.step)  # a rank moving through its phases is slow, not stuck
        if behind.age_s >= warn_s and key != self._warned and all(p.rank > self.rank for p in peers if p.waiting):
            self._warned, self._look_at = key, waited_s + warn_s
            self._say(f"trainkit: warning (rank {self.rank}): {behind.doing()} while the other ranks wait for it; "
                      f"the run stops if they wait timeout_s={timeout_s:g} s.")
        return False

    def peers(self) -> list[Peer]:
        """Every other rank's last beat (two reads of the store whatever the world size); none when a rank has not
        beaten yet or the store does not answer."""
        ranks = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"beat/{r}" for r in ranks]
        try:
            values = self.store.multi_get(keys) if self.store.check(keys) else []
        except Exception:
            return []
        return [p for p in map(Peer.parse, ranks, values) if p is not None]

    def verdict(self) -> str | None:
        """The failure, as recorded, or as written in the store by a peer that failed (it writes it before it tears
        its connections down, so a collective failing on this rank finds it there)."""
        if self.failure is None:
            with contextlib.suppress(Exception):
                if self.store.check([_VERDICT]):
                    self.failure = self.store.get(_VERDICT).decode()
        return self.failure

    def declare(self, verdict: str) -> None:
        """Tell every rank the run has failed, with ``verdict`` (the first verdict written stands)."""
        with contextlib.suppress(Exception):
            verdict = self.store.compare_set(_VERDICT, "", verdict).decode() or verdict
        self._fail(verdict)

    def _fail(self, verdict: str) -> None:
        if self.failure is not None or self._stop.is_set():
            return
        self.failure = verdict
        self._on_failure(verdict)

    def finish(self) -> None:
        """This rank is done (its process is about to exit): stop, and tell the watcher it did not die."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 5)
        with contextlib.suppress(Exception):
            self.store.set(f"beat/{self.rank}", "done")


class Waiter:
    """Waits for gloo's works whole, on a thread of its own, while the caller watches the heartbeat.

    A wait on one of gloo's point-to-point works that times out closes the connection to the peer ("Application
    timeout caused pair closure"), so a wait cut into slices to look at the heartbeat between them fails the run
    whenever a peer is a slice late: a pipeline stage compiling its blocks, a rank writing a checkpoint. Here the
    works are waited for in full on a daemon thread, and the caller waits on an event in slices instead: a verdict
    fails its wait at once, and a slow peer fails nothing. One thread serves the process, waits in order.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            works, done, errors = self._queue.get()
            try:
                for work in works:
                    work.wait()
            except BaseException as err:  # handed to the caller, which raises it
                errors.append(err)
            done.set()

    def wait(self, works: list[Any], slice_s: float, give_up: Callable[[], bool]) -> None:
        """Return once every one of ``works`` finished; raise what a wait raised, or ``TimeoutError`` when
        ``give_up()`` (checked every ``slice_s``) says to stop waiting."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="trainkit-gloo-waiter", daemon=True)
            self._thread.start()
        done, errors = threading.Event(), []
        self._queue.put((works, done, errors))
        while not done.wait(slice_s):
            if give_up():
                raise TimeoutError("gave up waiting for a peer")
        if errors:
            raise errors[0]
