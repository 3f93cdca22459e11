"""When a run ends with an error on this rank: the other ranks must hear of it at once (not at a 30-minute timeout),
the launcher must know, and a dead peer behind a failed wait must be named, with how to resume."""

from __future__ import annotations

from pathlib import Path

from trainkit import launcher, resume
from trainkit.errors import ConfigurationError
from trainkit.finite import NonFiniteError
from trainkit.signals import Preempted
from trainkit_strategies.communication.comm import Comm, PeerError, peer_failure

INTERRUPTED = "interrupted by SIGINT"  # the reason a rank stopped by Ctrl-C gives its peers


class Interrupted(KeyboardInterrupt):
    """A peer's Ctrl-C (SIGINT) ended the run: raised where this rank's wait failed because of it, so every rank of
    an interrupted run ends as the interrupted one does (``KeyboardInterrupt``; exit code 130 from the command
    line), not as a failed one."""


def leave_the_ranks(exc: BaseException, comm: Comm, world_size: int, checkpoint_dir: Path) -> BaseException | None:
    """After ``exc`` ended a run on this rank: abort the communicators (so peers fail fast, with the reason unless a
    peer failed first or the run was preempted), tell the launcher (unless preempted), and return the error to raise
    in ``exc``'s place, if any: ``Interrupted`` where a peer's Ctrl-C made this rank's wait fail, or a ``PeerError``
    naming the dead peer whose silence did, with the way to resume."""
    error = exc
    if isinstance(exc, ConfigurationError | NonFiniteError):  # every rank raises it alike: nothing to abort
        return None
    if world_size > 1:
        failure = peer_failure()
        if isinstance(exc, KeyboardInterrupt) and failure is None:
            comm.abort(INTERRUPTED)
        elif not isinstance(exc, Preempted | PeerError) and failure is None:
            comm.abort(f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            comm.abort()
        if not isinstance(exc, Preempted):
            launcher.failed()
        if failure is not None and failure.endswith(f"({INTERRUPTED})"):
            return None if isinstance(exc, KeyboardInterrupt) else Interrupted(failure)
        if failure is not None and not isinstance(exc, PeerError):  # a dead peer made this rank's wait fail
            error = PeerError(f"A collective across {world_size} ranks failed: {failure}. Original error: {exc}")
    if isinstance(error, PeerError):
        return PeerError(f"{error}\n{resume.resume_hint(checkpoint_dir)}")
    return None
