"""How a fit writes its checkpoints: the state checked, then written now or in the background, and what the ranks
agree on at every optimizer-step boundary (a preemption signal, an asynchronous save that is durable everywhere, a
non-finite step found on some rank).

Nothing non-finite is written: before any save the ranks agree that no rank saw a non-finite loss or gradient norm
and that the tensors about to be written are finite (``finite.py``), so a run that goes wrong keeps its last good
checkpoint as ``latest``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainkit import checkpoint as ckpt
from trainkit import finite, resume, storage
from trainkit.async_checkpoint import AsyncSaver
from trainkit.finite import FiniteGuard
from trainkit.seed import rng_state
from trainkit.signals import Preempted, StepSignals
from trainkit_strategies import Strategy


class Saving:
    """A Trainer's checkpoint writing: the asynchronous save in flight, the step-boundary signals and, during a fit,
    the non-finite guard.

    Args:
        strategy: the strategy whose control-plane group carries the boundary flags.
        on_nonfinite, max_nonfinite_skips: see ``Trainer``.
    """

    def __init__(self, strategy: Strategy, on_nonfinite: str, max_nonfinite_skips: int) -> None:
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip'; got {on_nonfinite!r}.")
        if max_nonfinite_skips < 1:
            raise ValueError(f"max_nonfinite_skips must be >= 1; got {max_nonfinite_skips}.")
        self.signals = StepSignals(strategy.comm.control())  # preemption and checkpoint progress
        self.saver = AsyncSaver()  # the asynchronous checkpoint in flight, if any
        self.on_nonfinite, self.max_nonfinite_skips = on_nonfinite, max_nonfinite_skips
        self.guard: FiniteGuard | None = None  # the current fit's

    def begin_fit(self, strategy: Strategy, rows: int, checkpoint_dir: Callable[[], Path]) -> FiniteGuard:
        """A new fit's guard; its errors name the checkpoint to resume from."""
        self.guard = FiniteGuard(strategy, self.on_nonfinite, self.max_nonfinite_skips, rows,
                                 lambda: finite.hint(resume.resume_hint(checkpoint_dir()), self.on_nonfinite))
        return self.guard

    def save(self, strategy: Strategy, meta: Callable[[], dict[str, Any]], dirpath: str | Path, name: str,
             update_latest: bool, async_save: bool, on_commit: Callable[[Path], None] | None) -> Path:
        """Collectively check and write checkpoint ``dirpath/name`` (see ``Trainer.save_checkpoint``)."""
        pieces, rank_state = strategy.state_pieces(), {"rng": rng_state()}
        if self.guard is not None:
            self.guard.agree(pieces)  # raises on every rank before anything is written
        if async_save:
            self.saver.start(Path(dirpath), name, strategy, meta(), pieces, rank_state, update_latest, on_commit)
            return Path(dirpath) / name
        self.saver.finish(strategy)
        try:  # a rank whose file cannot be written fails the commit on every rank (``checkpoint.write_rank_file``)
            path = ckpt.save(dirpath, name, strategy, meta(), pieces, rank_state, update_latest)
        except OSError as err:  # rank 0's directory, meta.json, rename or pointer
            shutil.rmtree(Path(dirpath) / f".tmp-{name}", ignore_errors=True)
            raise ckpt.CheckpointError(f"Writing checkpoint {Path(dirpath) / name} failed: {storage.describe(err)}. "
                                       f"{resume.resume_hint(Path(dirpath))}") from err
        except ckpt.CheckpointError as err:
            raise ckpt.CheckpointError(f"{err} {resume.resume_hint(Path(dirpath))}") from err
        if on_commit is not None:
            on_commit(path)
        return path

    def at_boundary(self, strategy: Strategy, step: int, save_now: Callable[[], Path], time_up: bool = False) -> bool:
        """After every optimizer step, on every rank: commit a durable asynchronous checkpoint; stop every rank
        together when one saw a non-finite step; on preemption, ``save_now`` and stop. Returns whether the ranks
        agree that training time is up (``time_up``: this rank's is), the same on every rank."""
        assert self.guard is not None
        preempt, written, nonfinite, late = self.signals.poll(self.saver, self.guard.found is not None, time_up)
        if written:
            self.saver.commit(strategy)
        if nonfinite:
            self.guard.agree()  # raises on every rank
        if preempt:
            raise Preempted(step, save_now())
        return late
