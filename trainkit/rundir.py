"""A checkpoint directory holds one run's checkpoints: a fresh run never replaces or deletes another's.

When a fit starts, rank 0 claims the directory its ``ModelCheckpoint`` writes to:

- A fresh run (no ``ckpt_path``) into a directory that already holds checkpoints writes its own into the first
  free sibling, ``<dir>-v1``, ``<dir>-v2``, ... (Lightning versions clashing names the same way), and says so: every
  earlier file, ``latest`` included, stays byte-identical.
- A resumed run writes into the directory of the checkpoint it resumed from (a sibling version included), and a name
  that is already taken there by a newer checkpoint gets a ``-v1`` suffix instead of replacing it
  (``ModelCheckpoint.save``).
- A directory in use by a live run is refused: ``.lock`` names the holder's host and PID. A lock whose process is
  gone (on this host) is taken over, with a line saying so.

``ckpt_path="last"`` looks at the directory and its versions and resumes the newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

from trainkit import checkpoint as ckpt
from trainkit import storage
from trainkit.errors import ConfigurationError

LOCK = ".lock"


def versions(base: Path) -> list[Path]:
    """``base`` and its existing versions ``base-v1``, ``base-v2``, ... in order."""
    pattern = re.compile(re.escape(base.name) + r"-v(\d+)")
    found = [(int(m.group(1)), p) for p in base.parent.glob(f"{base.name}-v*")
             if (m := pattern.fullmatch(p.name)) and p.is_dir()] if base.parent.is_dir() else []
    return [base, *(p for _, p in sorted(found))]


def used(directory: Path) -> bool:
    """Whether ``directory`` holds another run's work: a checkpoint (committed or set aside) or a ``latest``."""
    return (directory / ckpt.LATEST).exists() or bool(ckpt.listing(directory, hidden=True))


def newest(base: Path) -> Path | None:
    """The newest committed checkpoint that ``latest`` names in ``base`` or one of its versions (what ``"last"``
    resumes)."""
    found = [p for d in versions(base) if (p := ckpt.latest(d)) is not None]
    return max(found, key=lambda p: (p / ckpt.META).stat().st_mtime, default=None)


def choose(base: Path, resuming: Path | None) -> Path:
    """The directory this fit writes to: see the module docstring."""
    if resuming is not None:
        parent = resuming.parent.resolve()
        return next((d for d in versions(base) if d.resolve() == parent), base)
    if holder(base) is not None:
        return base  # in use by a live run: refused by ``Claim``, not worked around
    for directory in versions(base):
        if not used(directory) and holder(directory) is None:
            return directory
    return base.parent / f"{base.name}-v{len(versions(base))}"


def holder(directory: Path) -> dict | None:
    """The live run holding ``directory``'s lock, or None (no lock, or one whose process is gone)."""
    try:
        held = json.loads((directory / LOCK).read_text())
    except (OSError, ValueError):
        return None
    if held.get("host") == socket.gethostname() and not _alive(int(held.get("pid", 0))):
        return None
    return held


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Claim:
    """Rank 0's hold on a checkpoint directory for one fit (released when the fit ends)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / LOCK
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        while True:
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                break
            except FileExistsError:
                held = holder(directory)
                if held is not None and held.get("pid") != os.getpid():
                    raise ConfigurationError(
                        f"{directory} is in use by another run (host {held.get('host')}, PID {held.get('pid')}, "
                        f"since {held.get('since')}): two runs writing one checkpoint directory would delete each "
                        f"other's checkpoints. Use another --trainer.default_root_dir (or ModelCheckpoint dirpath), "
                        f"or wait for that run to end; if it is gone, delete {lock}.") from None
                stale = lock.read_text(errors="replace").strip()
                print(f"trainkit: taking over {lock}, left by a run that is gone ({stale}).", file=sys.stderr,
                      flush=True)
                lock.unlink(missing_ok=True)
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            (self.directory / LOCK).unlink()
            if self._created:
                self.directory.rmdir()  # only if empty: a fit that wrote nothing leaves nothing


def claim(callbacks: list, resuming: Path | None, strategy: Any) -> list[Claim]:
    """Collectively choose and lock the directory of every ``ModelCheckpoint`` for a fit (rank 0 decides, every rank
    learns the directories, or raises the same error)."""
    from trainkit.callbacks.checkpointing import ModelCheckpoint

    held: list[Claim] = []
    checkpointing = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    needed = storage.checkpoint_bytes(strategy) if checkpointing else 0
    for callback in checkpointing:
        base = callback.base_dirpath
        assert base is not None, "ModelCheckpoint.setup resolves its directory first"
        decided: tuple[Path | None, str | None] = (None, None)
        if strategy.is_global_zero:  # a Trainer's next fit continues its last one, in the same directory
            again = callback.claimed is not None and resuming is None
            directory = callback.claimed if again else choose(base, resuming)
            try:
                held.append(Claim(directory))
                decided = (directory, storage.preflight(directory, needed))
                storage.sweep(directory)
            except ConfigurationError as err:
                decided = (None, str(err))
            except OSError as err:
                decided = (None, storage.unwritable(directory, err))
            if directory != base and resuming is None and not again and decided[1] is None:
                print(f"trainkit: {base} holds the checkpoints of an earlier run; this run writes its own to "
                      f"{directory} and leaves those as they are (resume the earlier run with --ckpt_path "
                      f"{base}/<checkpoint>).", flush=True)
        directory, error = strategy.broadcast_object(decided) if strategy.world_size > 1 else decided
        if error is not None:
            for claimed in held:
                claimed.release()
            raise ConfigurationError(error)
        callback.dirpath = callback.claimed = directory
    return held
