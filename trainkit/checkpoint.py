"""Universal checkpoints: a directory any strategy at any world size can load.

Layout of ``<dirpath>/<name>/``:

- ``rank00000.safetensors`` ...: the tensor ranges each rank owns, one entry per ``Piece`` named
  ``<key>@<start>`` (flattened; ``key`` is ``model/<param>`` or ``optim/<param>/<state>``).
- ``meta.json``: versions, loop/scheduler/scaler/callback state, hyperparameters, per-rank RNG, the
  table of every tensor's global shape, dtype and pieces, per-file sha256 and size, and the sha256 of
  meta.json itself (``meta_sha256``, computed with that field empty).

Writes are atomic: every rank writes into ``.tmp-<name>``; only after all ranks finished does rank 0
write meta.json, rename the directory into place and then replace the ``latest`` pointer. A crash at
any point before that leaves the previous checkpoint and ``latest`` untouched. No pickle is ever loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from trainkit_strategies import Strategy
from trainkit_strategies.state import Piece

FORMAT = "trainkit-checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _meta_digest(meta: dict) -> str:
    body = json.dumps({**meta, "meta_sha256": ""}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save(
    dirpath: str | Path, name: str, strategy: Strategy, meta: dict[str, Any], pieces: Iterable[Piece],
    rank_state: dict[str, Any], update_latest: bool = True,
) -> Path:
    """Collectively write checkpoint ``dirpath/name``; every rank must call this."""
    dirpath = Path(dirpath)
    final, tmp = dirpath / name, dirpath / f".tmp-{name}"
    if strategy.is_global_zero:
        dirpath.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    strategy.barrier()
    filename = f"rank{strategy.rank:05d}.safetensors"
    pieces = list(pieces)
    files: dict[str, dict[str, Any]] = {}
    if pieces:
        tensors = {f"{p.key}@{p.start}": p.data.detach().contiguous().cpu() for p in pieces}
        save_file(tensors, str(tmp / filename))
        with open(tmp / filename, "rb") as f:
            os.fsync(f.fileno())
        files[filename] = {"sha256": _sha256(tmp / filename), "bytes": (tmp / filename).stat().st_size}
    table = [(p.key, list(p.shape), _dtype_name(p.dtype), p.start, p.stop, filename) for p in pieces]
    gathered = strategy.all_gather_object((files, table, rank_state))
    if strategy.is_global_zero:
        tensors_meta: dict[str, dict[str, Any]] = {}
        all_files: dict[str, Any] = {}
        for rank_files, rank_table, _ in gathered:
            all_files.update(rank_files)
            for key, shape, dtype, start, stop, file in rank_table:
                entry = tensors_meta.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
                entry["pieces"].append({"file": file, "start": start, "stop": stop})
        for entry in tensors_meta.values():
            entry["pieces"].sort(key=lambda p: p["start"])
        full = {
            "format": FORMAT,
            "version": VERSION,
            "torch_version": torch.__version__,
            **meta,
            "world_size": strategy.world_size,
            "ranks": [r for _, _, r in gathered],
            "tensors": tensors_meta,
            "files": all_files,
        }
        full["meta_sha256"] = _meta_digest(full)
        _fsync_write(tmp / META, json.dumps(full, indent=1, sort_keys=True))
        if final.exists():
            trash = dirpath / f".old-{name}"
            shutil.rmtree(trash, ignore_errors=True)
            final.rename(trash)
            tmp.rename(final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(final)
        if update_latest:
            pointer = dirpath / f".{LATEST}.tmp"
            _fsync_write(pointer, name)
            os.replace(pointer, dirpath / LATEST)
    strategy.barrier()
    return final


def latest(dirpath: str | Path) -> Path | None:
    """The checkpoint the ``latest`` pointer in ``dirpath`` names, or None."""
    pointer = Path(dirpath) / LATEST
    if not pointer.is_file():
        return None
    target = Path(dirpath) / pointer.read_text().strip()
    if not (target / META).is_file():
        raise CheckpointError(
            f"{pointer} points at {target.name!r}, which is not a complete checkpoint. "
            f"Pass --ckpt_path with one of: {', '.join(str(p) for p in listing(dirpath)) or '(none)'}."
        )
    return target


def listing(dirpath: str | Path) -> list[Path]:
    """Committed checkpoints in ``dirpath``, oldest first."""
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META).is_file()]
    return sorted(found, key=lambda p: (p / META).stat().st_mtime)


def read_meta(path: str | Path) -> dict[str, Any]:
    """meta.json, checked against its own digest."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a trainkit checkpoint: {meta_path} does not exist.")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"Checkpoint file {meta_path} is corrupt (not valid JSON: {err}).") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a trainkit checkpoint (format field missing).")
    if meta.get("meta_sha256") != _meta_digest(meta):
        raise CheckpointError(f"Checkpoint file {meta_path} is corrupt: its content does not match its sha256.")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path} was written by a newer trainkit (format version {meta['version']}); upgrade trainkit."
        )
    return meta


class CheckpointReader:
    """Reads flat ranges of a checkpoint's tensors; verifies each file's size and sha256 before use."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self._tensors: dict[str, dict[str, Any]] = self.meta["tensors"]
        self._handles: dict[str, Any] = {}

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        entry = self._tensors.get(key)
        if entry is None:
            return None
        return tuple(entry["shape"]), getattr(torch, entry["dtype"])

    def _open(self, file: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            self._verify(file)
            handle = self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return handle

    def _verify(self, file: str) -> None:
        path = self.path / file
        expected = self.meta["files"].get(file)
        hint = (f"The checkpoint {self.path} cannot be used; resume from another one "
                f"({', '.join(p.name for p in listing(self.path.parent) if p != self.path) or 'none left'}).")
        if expected is None:
            raise CheckpointError(f"Checkpoint file {path} is not listed in meta.json. {hint}")
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {path} is missing. {hint}")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"Checkpoint file {path} is truncated or altered: {size} bytes, expected {expected['bytes']}. {hint}"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"Checkpoint file {path} is corrupt: sha256 mismatch. {hint}")

    def read(self, key: str, start: int, stop: int) -> Tensor:
        entry = self._tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}.")
        parts, cursor = [], start
        for piece in entry["pieces"]:
            lo, hi = max(cursor, piece["start"]), min(stop, piece["stop"])
            if lo >= hi:
                continue
            if lo != cursor:
                break
            part = self._open(piece["file"]).get_slice(f"{key}@{piece['start']}")
            parts.append(part[lo - piece["start"] : hi - piece["start"]])
            cursor = hi
            if cursor == stop:
                break
        if cursor != stop:
            raise CheckpointError(
                f"{self.path} does not hold elements [{cursor}, {stop}) of {key!r}: a rank's file is missing."
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def full(self, key: str) -> Tensor:
        shape, _ = self.info(key) or ((), None)
        return self.read(key, 0, max(1, math.prod(shape))).reshape(shape)
