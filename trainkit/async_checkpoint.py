"""Asynchronous checkpoints: snapshot at the step boundary, write in the background, commit when durable.

At the save point every rank copies the pieces it owns into host memory (pinned on CUDA, buffers
reused from one save to the next) and hands them to a background thread, which writes and fsyncs the
rank's file while training goes on. The commit (meta.json, the rename into place, the ``latest``
pointer) is collective and happens on the main thread, at the first step boundary where every rank
reports its file durable (``StepSignals`` carries that flag), or when the next save or the end of
training waits for it. Until then the previous checkpoint and ``latest`` are untouched, so a crash
during the write loses only the checkpoint being written. At most one save is in flight.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainkit import checkpoint as ckpt
from trainkit_strategies import Strategy
from trainkit_strategies.state.pieces import Piece


class HostSnapshot:
    """Host copies of pieces, in one flat buffer per dtype (pinned when the pieces live on a GPU), reused while
    the layout stays the same: pinned allocations cost more than the copy."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}

    def take(self, pieces: list[Piece]) -> list[Piece]:
        sizes: dict[torch.dtype, int] = {}
        for p in pieces:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.data.numel()
        cuda = any(p.data.device.type == "cuda" for p in pieces)
        for dtype, size in sizes.items():
            held = self._buffers.get(dtype)
            if held is None or held.numel() != size:
                self._buffers[dtype] = torch.empty(size, dtype=dtype, device="cpu", pin_memory=cuda)
        offsets = dict.fromkeys(sizes, 0)
        out = []
        for p in pieces:
            start = offsets[p.dtype]
            host = self._buffers[p.dtype][start : start + p.data.numel()].view(p.data.shape)
            host.copy_(p.data.detach(), non_blocking=cuda)
            offsets[p.dtype] = start + p.data.numel()
            out.append(dataclasses.replace(p, data=host))
        if cuda:
            torch.cuda.synchronize()  # the copies are complete before training changes the device tensors
        return out


class AsyncSaver:
    """One background checkpoint write at a time, committed collectively on the main thread."""

    def __init__(self) -> None:
        self._snapshot = HostSnapshot()
        self._thread: threading.Thread | None = None
        self._staged: ckpt.Staged | None = None
        self._written: ckpt.Written | None = None
        self._on_commit: Callable[[Path], None] | None = None
        self.serial = 0  # counts saves started; the in-flight one is ``serial``

    @property
    def pending(self) -> bool:
        """A save was started and is not committed yet."""
        return self._staged is not None

    @property
    def written(self) -> bool:
        """This rank's file of the pending save is durable (or its write failed)."""
        return self._staged is not None and self._thread is not None and not self._thread.is_alive()

    def start(self, dirpath: Path, name: str, strategy: Strategy, meta: dict[str, Any], pieces: list[Piece],
              rank_state: dict[str, Any], update_latest: bool = True,
              on_commit: Callable[[Path], None] | None = None) -> None:
        """Collectively begin a save: finish the previous one, snapshot this rank's pieces, write in the
        background. ``on_commit(path)`` runs on every rank once the checkpoint is visible."""
        self.finish(strategy)
        staged = ckpt.begin(dirpath, name, strategy, meta, rank_state, update_latest)
        host = self._snapshot.take(pieces)
        self._staged, self._written, self._on_commit = staged, None, on_commit
        self.serial += 1
        self._thread = threading.Thread(target=self._write, args=(staged.tmp, strategy.rank, host),
                                        name=f"trainkit-checkpoint-{name}", daemon=True)
        self._thread.start()

    def _write(self, tmp: Path, rank: int, pieces: list[Piece]) -> None:
        try:
            self._written = ckpt.write_rank_file(tmp, rank, pieces)
        except BaseException as err:  # reported to every rank at the commit, which then fails on all of them
            self._written = ckpt.Written(error=f"{type(err).__name__}: {err}")

    def commit(self, strategy: Strategy) -> Path | None:
        """Collectively commit the pending save; call it only when every rank's write is done."""
        if self._staged is None:
            return None
        assert self._thread is not None
        self._thread.join()
        staged, written, on_commit = self._staged, self._written, self._on_commit
        self._staged = self._thread = self._written = self._on_commit = None
        assert written is not None
        path = ckpt.commit(staged, strategy, written)
        if on_commit is not None:
            on_commit(path)
        return path

    def finish(self, strategy: Strategy) -> Path | None:
        """Wait for the pending save (if any) and commit it (collective)."""
        return self.commit(strategy) if self._staged is not None else None
