"""When a run ends with an error on this rank: the other ranks must hear of it at once (not at a 30-minute timeout),
the launcher must know, and a dead peer behind a failed wait must be named, with how to resume."""

from __future__ import annotations

from pathlib import Path

from trainkit import launcher, resume
from trainkit.errors import ConfigurationError
from trainkit.finite import NonFiniteError
from trainkit.signals import Preempted
from trainkit_strategies.comm import Comm, PeerError, peer_failure


def leave_the_ranks(exc: BaseException, comm: Comm, world_size: int, checkpoint_dir: Path) -> PeerError | None:
    """After ``exc`` ended a run on this rank: abort the communicators (so peers fail fast, with the reason unless a
    peer failed first or the run was preempted), tell the launcher (unless preempted), and return the error to raise
    in ``exc``'s place, if any: a ``PeerError`` naming the dead peer whose silence made this rank's wait fail, with
    the way to resume."""
    error = exc
    if isinstance(exc, ConfigurationError | NonFiniteError):  # every rank raises it alike: nothing to abort
        return None
    if world_size > 1:
        failure = peer_failure()
        if not isinstance(exc, Preempted | PeerError) and failure is None:
            comm.abort(f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            comm.abort()
        if not isinstance(exc, Preempted):
            launcher.failed()
        if failure is not None and not isinstance(exc, PeerError):  # a dead peer made this rank's wait fail
            error = PeerError(f"A collective across {world_size} ranks failed: {failure}. Original error: {exc}")
    if isinstance(error, PeerError):
        return PeerError(f"{error}\n{resume.resume_hint(checkpoint_dir)}")
    return None
