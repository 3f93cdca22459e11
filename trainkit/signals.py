"""Preemption, and what every rank agrees on at an optimizer-step boundary.

SLURM and Kubernetes send SIGTERM before they kill a job (SLURM's ``--signal=USR1@90`` sends SIGUSR1
ahead of time). During ``fit`` trainkit turns either signal, on any rank, into one checkpoint written
by every rank at a step boundary and an exit with ``PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL``: try
again); running the same command again with ``ckpt_path="last"`` continues exactly.

A signal reaches one rank, but the decision must be the same on all of them, so at every boundary the ranks
all-reduce four flags on a control-plane group (``Comm.control``): "a signal arrived here", "my file of the
pending asynchronous checkpoint is durable", "I saw a non-finite loss" (``finite.py``) and "my training time is up"
(``max_time``, the ``Timer`` callback). The reduce is
asynchronous: it is posted at one boundary and read at the next, so it costs no waiting, and the agreed
decision comes one step after the flag was raised (at once on a single process).

A step may never come (a hung data loader, a user step that waits forever, a validation longer than the job's
notice): if no step boundary follows the signal within ``stop_grace_s()`` (20 s, or three times the longest step
seen, whichever is longer), the rank says so and exits with the same code, without a new checkpoint; the last
committed one is intact.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from trainkit.async_checkpoint import AsyncSaver
from trainkit_strategies.communication.comm import Comm, Handle

PREEMPTED_EXIT_CODE = 75
GRACE_ENV = "TRAINKIT_STOP_GRACE_S"


def stop_grace_s(longest_step_s: float) -> float:
    """How long after a preemption signal a rank waits for a step boundary: ``$TRAINKIT_STOP_GRACE_S`` (default 20)
    or three times the longest step seen so far, whichever is longer."""
    floor = float(os.environ.get(GRACE_ENV, "") or 20.0)
    return max(floor, 3.0 * longest_step_s)
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is committed; exits with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, step: int, checkpoint: Any) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.checkpoint = step, checkpoint

    def __str__(self) -> str:
        return (f"preempted at step {self.step}: checkpoint {self.checkpoint} is committed; run the same command "
                f"with ckpt_path='last' (--ckpt_path last) to continue (exit code {PREEMPTED_EXIT_CODE}).")


class StepSignals:
    """Catches preemption signals during fit and agrees on them, and on checkpoint progress, at boundaries."""

    def __init__(self, control: Comm) -> None:
        self.control = control
        self.requested = False  # a signal arrived on this rank
        self.signal_name = ""
        self._previous: dict[int, Any] = {}
        self._handle: Handle | None = None
        self._flags = torch.zeros(4, dtype=torch.int32, device="cpu")
        self._serial = 0  # the asynchronous save the posted flags are about
        self._hint: Callable[[], str] = lambda: ""
        self._boundary = threading.Event()  # a step boundary came after the signal (or the run ended)
        self._last_poll: float | None = None
        self.longest_step_s = 0.0

    def install(self, hint: Callable[[], str] = lambda: "") -> None:
        """Catch SIGTERM and SIGUSR1 until ``uninstall`` (only the main thread can; elsewhere nothing changes).
        ``hint``: what to say about the last committed checkpoint if no step comes after a signal."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._hint, self._last_poll = hint, None
        self._boundary.clear()
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            grace = stop_grace_s(self.longest_step_s)
            print(f"trainkit: received {self.signal_name}; saving a checkpoint at the next optimizer step and "
                  f"stopping (or, if no step comes within {grace:.0f} s, stopping without one).", file=sys.stderr,
                  flush=True)
            threading.Thread(target=self._stop_unless_a_step_comes, args=(grace,), daemon=True,
                             name="trainkit-stop-grace").start()
        self.requested = True

    def _stop_unless_a_step_comes(self, grace: float) -> None:
        if self._boundary.wait(grace):
            return
        print(f"trainkit: no optimizer step came within {grace:.0f} s of {self.signal_name}; stopping without a new "
              f"checkpoint (exit code {PREEMPTED_EXIT_CODE}). {self._hint()}", file=sys.stderr, flush=True)
        os._exit(PREEMPTED_EXIT_CODE)  # the main thread may be blocked where no exception reaches it

    def uninstall(self, clean: bool = True) -> None:
        """Restore the previous handlers; with ``clean`` (every rank got here), also wait for the posted reduce."""
        self._boundary.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if clean and self._handle is not None:
            self._handle.wait()
        self._handle = None

    def poll(self, saver: AsyncSaver, nonfinite: bool = False, time_up: bool = False
             ) -> tuple[bool, bool, bool, bool]:
        """At a boundary (every rank): whether every rank should stop for preemption, whether every rank's file of
        the pending asynchronous save is durable (the save can be committed), whether a rank saw a non-finite
        loss or gradient norm (``nonfinite`` here: every rank stops), and whether a rank's training time is up
        (``time_up`` here: every rank stops training after this step)."""
        now = time.monotonic()
        if self._last_poll is not None:
            self.longest_step_s = max(self.longest_step_s, now - self._last_poll)
        self._last_poll = now
        if self.requested:
            self._boundary.set()  # steps still come: the checkpoint is written at the agreed boundary
        if not self.control.active:
            return self.requested, saver.written, nonfinite, time_up
        preempt = written = found = late = False
        if self._handle is not None:
            self._handle.wait()
            preempt = bool(self._flags[0] > 0)
            written = bool(self._flags[1] == self.control.world_size) and saver.pending \
                and self._serial == saver.serial
            found = bool(self._flags[2] > 0)
            late = bool(self._flags[3] > 0)
        self._flags = torch.tensor([int(self.requested), int(saver.written), int(nonfinite), int(time_up)],
                                   dtype=torch.int32, device="cpu")
        self._serial = saver.serial
        self._handle = self.control.all_reduce(self._flags, async_op=True)
        return preempt, written, found, late
