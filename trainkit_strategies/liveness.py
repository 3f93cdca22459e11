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
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_VERDICT = "verdict"


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
    """

    def __init__(self, store: Any, rank: int, world_size: int, dead_after_s: float,
                 on_failure: Callable[[str], None], interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore("trainkit/heartbeat", store)
        self.rank, self.world_size, self.dead_after_s = rank, world_size, dead_after_s
        self.interval_s = min(interval_s, dead_after_s / 4)
        self.failure: str | None = None
        self._on_failure = on_failure
        self._clock = clock
        self._neighbour = (rank + 1) % world_size
        self._beats, self._seen, self._changed = 0, None, clock()  # the neighbour's counter, and when it moved
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainkit-heartbeat", daemon=True)
        if start:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self.beat():
            pass

    def beat(self) -> bool:
        """One beat: bump this rank's counter, read the verdict and the neighbour's counter. Returns False once the
        run has failed (a verdict read or declared here) or the store stopped answering: no more beats."""
        neighbour = self._neighbour
        try:
            self._beats += 1
            self.store.set(f"beat/{self.rank}", str(self._beats))
            if self.store.check([_VERDICT]):
                self._fail(self.store.get(_VERDICT).decode())
                return False
            value = self.store.get(f"beat/{neighbour}") if self.store.check([f"beat/{neighbour}"]) else None
        except Exception as err:  # the store's host is gone (or unreachable): rank 0 died
            if not self._stop.is_set():
                self._fail(f"the rendezvous store stopped answering ({type(err).__name__}): rank 0, which "
                           "hosts it, died or its machine is unreachable")
            return False
        now = self._clock()
        if value == b"done":  # it finished its run
            return True
        if value != self._seen:
            self._seen, self._changed = value, now
        elif self._seen is not None and now - self._changed > self.dead_after_s:
            self.declare(f"rank {neighbour} stopped answering: no heartbeat for {now - self._changed:.0f} s (it "
                         "died, was killed, or froze)")
            return False
        return True

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
