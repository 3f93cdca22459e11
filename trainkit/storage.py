"""Storage faults, said once and early: a checkpoint directory that cannot be written, or has no room for a
checkpoint, is found when a fit starts, not at its first save after the work is done; a save that fails on a full
disk, a read-only file system or a file-size limit is one ``CheckpointError`` that says why and names the intact
previous checkpoint, and leaves no half-written ``.tmp-<name>`` behind (nor does a crash: the next fit sweeps
them).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

from trainkit_strategies import Strategy

WHY = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "a file grew past the size limit (ulimit -f, or the file system's)",
}


def describe(err: OSError) -> str:
    """An ``OSError`` as the storage fault it is."""
    why = WHY.get(err.errno or 0, err.strerror or str(err))
    where = f" ({err.filename})" if err.filename else ""
    return f"{why}{where} [{errno.errorcode.get(err.errno or 0, 'OSError')}]"


def checkpoint_bytes(strategy: Strategy) -> tuple[int, int]:
    """What one checkpoint will take over every rank, and its largest rank file: the pieces each rank holds now,
    with room for an Adam-like optimizer's two state tensors per floating-point parameter where the optimizer has
    not made them yet (before its first step). Collective."""
    pieces = strategy.state_pieces()
    held = sum(p.data.numel() * p.data.element_size() for p in pieces)
    if not any(p.key.startswith("optim/") for p in pieces):
        held += 2 * sum(p.data.numel() * 4 for p in pieces if p.key.startswith("model/")
                        and p.data.is_floating_point())
    every = strategy.all_gather_object(held) if strategy.world_size > 1 else [held]
    return sum(every), max(every)


def preflight(directory: Path, needed: tuple[int, int]) -> str | None:
    """Why a fit could not write a checkpoint of ``needed`` bytes (in all, and its largest file) into ``directory``
    (None: it can): the directory is tried with a file of its own, its free space read, and the file-size limit
    (``ulimit -f``) compared with the largest file."""
    probe = directory / f".write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"trainkit")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return unwritable(directory, err)
    finally:
        probe.unlink(missing_ok=True)
    total, largest = needed
    free = shutil.disk_usage(directory).free
    if free < total:
        return (f"{directory} has {_size(free)} free, and one checkpoint of this run takes about {_size(total)}: "
                "free some space or point --trainer.default_root_dir (or ModelCheckpoint dirpath) elsewhere.")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource is not None else -1
    if 0 <= limit < largest:
        return (f"Files may not grow past {_size(limit)} here (ulimit -f), and this run's checkpoint files take up to "
                f"about {_size(largest)}: raise the limit (ulimit -f unlimited) before starting the run.")
    return None


def unwritable(directory: Path, err: OSError) -> str:
    return (f"Checkpoints cannot be written to {directory}: {describe(err)}. Point --trainer.default_root_dir (or "
            "ModelCheckpoint dirpath) at a writable directory, or pass --trainer.enable_checkpointing false.")


def sweep(directory: Path) -> None:
    """Remove what interrupted saves left in ``directory`` (``.tmp-<name>``): never visible as checkpoints, they
    would only fill the disk."""
    if directory.is_dir():
        for leftover in directory.glob(".tmp-*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
