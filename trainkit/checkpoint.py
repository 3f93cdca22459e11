"""Universal checkpoints: a directory any strategy at any world size can load.

Layout of ``<dirpath>/<name>/``:

- ``rank00000.safetensors`` ...: the tensor ranges each rank owns, one entry per ``Piece`` named
  ``<key>@<start>`` (flattened; ``key`` is ``model/<param>`` or ``optim/<param>/<state>``).
- ``meta.json``: versions, loop/scheduler/scaler/callback state, hyperparameters, per-rank RNG, the
  table of every tensor's global shape, dtype and pieces, per-file sha256 and size, and the sha256 of
  meta.json itself (``meta_sha256``, computed with that field empty).

Writes are atomic: every rank writes into ``.tmp-<name>``; only after all ranks finished does rank 0
write meta.json, move the directory into place and then replace the ``latest`` pointer, fsyncing the files
and then the directory after every rename, so what is visible is also durable. A checkpoint written over
one of the same name is swapped in with one atomic exchange of the two directories (``renameat2``'s
``RENAME_EXCHANGE`` on Linux), so at every instant ``<name>`` is a complete checkpoint and ``latest`` never
points at nothing; where the exchange is not available the old copy is set aside as ``.old-<name>`` first, and
a ``latest`` naming a checkpoint that is not there finds that copy. A crash at any point leaves a complete
checkpoint that ``latest`` names. No pickle is ever loaded, and nothing outside the checkpoint's directory is read
(``checkpoint_files``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainkit.checkpoint_files import NotRegular, holds_file, open_dir, open_regular, read_name, sha256, table_problem
from trainkit.storage import describe
from trainkit_strategies import Strategy
from trainkit_strategies.state.pieces import Piece, Strided, overlaps

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_FROM_SAFETENSORS = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
FORMAT = "trainkit-checkpoint"
VERSION = 2  # 2: tensor-parallel pieces (``strided``)
LATEST = "latest"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta_digest(meta: dict) -> str:
    plain = json.loads(json.dumps({**meta, "meta_sha256": ""}))  # as read back: integer keys (MultiStepLR's) as strings
    return hashlib.sha256(json.dumps(plain, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the renames inside directory ``path`` durable (a rename is an update of its directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot, and nothing was changed."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False  # the kernel or the file system cannot exchange
    raise OSError(error, f"exchanging {a} and {b}: {os.strerror(error)}")


@dataclass
class Staged:
    """A checkpoint being written: every rank's files go into ``tmp`` until the commit renames it ``final``."""

    dirpath: Path
    name: str
    meta: dict[str, Any]
    rank_state: dict[str, Any]
    update_latest: bool = True

    @property
    def tmp(self) -> Path:
        return self.dirpath / f".tmp-{self.name}"

    @property
    def final(self) -> Path:
        return self.dirpath / self.name


@dataclass
class Written:
    """What one rank wrote: its file's size and sha256, and the table of its pieces."""

    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    table: list[tuple] = field(default_factory=list)
    error: str | None = None


def begin(dirpath: str | Path, name: str, strategy: Strategy, meta: dict[str, Any], rank_state: dict[str, Any],
          update_latest: bool = True) -> Staged:
    """Collectively start checkpoint ``dirpath/name``: rank 0 makes the empty temporary directory."""
    staged = Staged(Path(dirpath), name, meta, rank_state, update_latest)
    if strategy.is_global_zero:
        staged.dirpath.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staged.tmp, ignore_errors=True)
        staged.tmp.mkdir()
    strategy.barrier()
    return staged


def safetensors_header(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header for tensors ``(name, shape, dtype)`` laid out in order (8-byte length, JSON padded
    so the payload starts 8-byte aligned), and each tensor's byte offset in the payload."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, offset = {}, 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offsets[name] = offset
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def write_safetensors(path: Path, tensors: dict[str, Tensor]) -> str:
    """Write host ``tensors`` as a safetensors file and fsync it; returns its sha256, hashed from the bytes as
    they are written (nothing is serialised into a second buffer, and the file is never read back)."""
    header, _ = safetensors_header((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
    digest = hashlib.sha256(header)
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def _stored_name(key: str, start: int, strided: Strided | None) -> str:
    """A piece's name in its rank's file: the key and where the piece starts (in the part, for a strided one)."""
    return f"{key}@{start}" if strided is None else f"{key}@{strided.origin}+{start}"


def write_rank_file(tmp: Path, rank: int, pieces: list[Piece]) -> Written:
    """Write this rank's pieces (host tensors) into ``tmp`` and make them durable; no communication."""
    filename = f"rank{rank:05d}.safetensors"
    written = Written(table=[(p.key, list(p.shape), _dtype_name(p.dtype), p.start, p.stop, filename,
                              None if p.strided is None else [p.strided.origin, p.strided.block, p.strided.stride])
                             for p in pieces])
    if pieces:
        path = tmp / filename
        try:
            sha = write_safetensors(path, {_stored_name(p.key, p.start, p.strided): p.data for p in pieces})
        except OSError as err:  # a full disk, say: every rank hears of it at the commit, which fails on all of them
            return Written(error=describe(err))
        written.files[filename] = {"sha256": sha, "bytes": path.stat().st_size}
    return written


def commit(staged: Staged, strategy: Strategy, written: Written) -> Path:
    """Collectively make ``staged`` visible once every rank's file is durable: rank 0 writes meta.json, renames
    the directory into place, then moves ``latest``. A rank whose write failed fails the commit on every rank
    and leaves the previous checkpoint and ``latest`` as they were."""
    gathered = strategy.all_gather_object((written.files, written.table, staged.rank_state, written.error))
    errors = [f"rank {r}: {err}" for r, (_, _, _, err) in enumerate(gathered) if err is not None]
    if errors:
        if strategy.is_global_zero:
            shutil.rmtree(staged.tmp, ignore_errors=True)
        raise CheckpointError(f"Writing checkpoint {staged.final} failed ({'; '.join(errors)}); the previous "
                              "checkpoint and the latest pointer are unchanged.")
    if strategy.is_global_zero:
        tensors_meta: dict[str, dict[str, Any]] = {}
        all_files: dict[str, Any] = {}
        for rank_files, rank_table, _, _ in gathered:
            all_files.update(rank_files)
            for key, shape, dtype, start, stop, file, strided in rank_table:
                entry = tensors_meta.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
                entry["pieces"].append({"file": file, "start": start, "stop": stop} |
                                       ({"strided": strided} if strided is not None else {}))
        for entry in tensors_meta.values():
            entry["pieces"].sort(key=lambda p: (p.get("strided", [0])[0], p["start"]))
        full = {
            "format": FORMAT,
            "version": VERSION,
            "torch_version": torch.__version__,
            **staged.meta,
            "world_size": strategy.world_size,
            "ranks": [r for _, _, r, _ in gathered],
            "tensors": tensors_meta,
            "files": all_files,
        }
        full["meta_sha256"] = _meta_digest(full)
        _fsync_write(staged.tmp / META, json.dumps(full, indent=1, sort_keys=True))
        _fsync_dir(staged.tmp)
        _move_into_place(staged)
        if staged.update_latest:
            pointer = staged.dirpath / f".{LATEST}.tmp"
            _fsync_write(pointer, staged.name)
            os.replace(pointer, staged.dirpath / LATEST)
            _fsync_dir(staged.dirpath)
    strategy.barrier()
    return staged.final


def _move_into_place(staged: Staged) -> None:
    """``staged.tmp`` becomes ``staged.final`` durably, a checkpoint of that name already there or not."""
    final, trash = staged.final, staged.dirpath / f".old-{staged.name}"
    if not final.exists():
        staged.tmp.rename(final)
    elif _exchange(staged.tmp, final):  # the new one is in place in one step; the old one is in tmp
        _fsync_dir(staged.dirpath)
        shutil.rmtree(staged.tmp, ignore_errors=True)
    else:
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)  # until the next rename, ``latest`` finds the old copy here (see ``latest``)
        staged.tmp.rename(final)
        _fsync_dir(staged.dirpath)
        shutil.rmtree(trash, ignore_errors=True)
    _fsync_dir(staged.dirpath)


def save(dirpath: str | Path, name: str, strategy: Strategy, meta: dict[str, Any], pieces: Iterable[Piece],
         rank_state: dict[str, Any], update_latest: bool = True) -> Path:
    """Collectively write checkpoint ``dirpath/name``; every rank must call this."""
    staged = begin(dirpath, name, strategy, meta, rank_state, update_latest)
    host = [dataclasses.replace(p, data=p.data.detach().contiguous().cpu()) for p in pieces]
    return commit(staged, strategy, write_rank_file(staged.tmp, strategy.rank, host))


def latest(dirpath: str | Path) -> Path | None:
    """The checkpoint the ``latest`` pointer in ``dirpath`` names, or None. A pointer whose checkpoint was being
    replaced when the process died (only possible where directories cannot be exchanged atomically) finds the
    copy set aside as ``.old-<name>``. The pointer must be one line of UTF-8 naming a directory inside ``dirpath``:
    an absolute path, ``..`` or a symbolic link is refused."""
    root = Path(dirpath)
    try:
        name = read_name(root, LATEST)
    except ValueError as err:
        problem = str(err)
    else:
        if name is None:
            return None
        for found in (root / name, root / f".old-{name}"):
            if holds_file(found, META):
                return found
        problem = f"points at {name!r}, which is " + ("a symbolic link" if (root / name).is_symlink() else
                                                      "not a complete checkpoint")
    complete = ", ".join(str(p) for p in listing(root, hidden=True)) or "(none)"
    raise CheckpointError(f"{root / LATEST} {problem}. Pass --ckpt_path with one of the complete checkpoints found: "
                          f"{complete}.")


def listing(dirpath: str | Path, hidden: bool = False) -> list[Path]:
    """Committed checkpoints in ``dirpath``, oldest first; with ``hidden`` also complete copies a crash left
    aside (``.old-<name>``, a written ``.tmp-<name>``). Symbolic links are not checkpoints of ``dirpath``."""
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if (hidden or not p.name.startswith(".")) and holds_file(p, META)]
    return sorted(found, key=lambda p: (p / META).stat().st_mtime)


def _fall_back(path: Path) -> str:
    """What a user whose checkpoint ``path`` cannot be read does instead."""
    others = ", ".join(p.name for p in listing(path.parent) if p != path) or "none left"
    return f"The checkpoint {path} cannot be used; resume from another one ({others})."


def read_meta(path: str | Path, dir_fd: int | None = None) -> dict[str, Any]:
    """meta.json, checked against its own digest and for a table that names only files inside ``path``;
    ``dir_fd``: ``path`` already opened (a reader's, which keeps it)."""
    path = Path(path)
    if dir_fd is None:
        fd = _open_dir(path)
        try:
            return read_meta(path, fd)
        finally:
            os.close(fd)
    meta_path = path / META
    try:
        with os.fdopen(open_regular(META, dir_fd), "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is not a trainkit checkpoint: {meta_path} does not exist.") from err
    except (NotRegular, ValueError) as err:  # a link; not JSON, or not UTF-8
        what = "is not a regular file (a symbolic link, say)" if isinstance(err, NotRegular) else \
            f"is corrupt (not valid JSON: {err})"
        raise CheckpointError(f"Checkpoint file {meta_path} {what}. {_fall_back(path)}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a trainkit checkpoint (format field missing). {_fall_back(path)}")
    if meta.get("meta_sha256") != _meta_digest(meta):
        raise CheckpointError(f"Checkpoint file {meta_path} is corrupt: its content does not match its sha256. "
                              f"{_fall_back(path)}")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{path} was written by a newer trainkit (format version {meta['version']}); upgrade trainkit."
        )
    problem = table_problem(meta, {_dtype_name(dtype) for dtype in SAFETENSORS_DTYPES})
    if problem is not None:
        raise CheckpointError(f"Checkpoint file {meta_path} is refused: {problem}; only files inside {path} are "
                              f"read. {_fall_back(path)}")
    return meta


def _open_dir(path: Path) -> int:
    try:
        return open_dir(path)
    except OSError as err:
        raise CheckpointError(f"{path} is not a trainkit checkpoint: {path / META} does not exist.") from err


class CheckpointReader:
    """Reads flat ranges of a checkpoint's tensors; verifies each file's size and sha256 before use.

    Ranges are read with ``os.pread`` at offsets from the safetensors header, not through a memory map: a
    map keeps what was read resident, so streaming a large checkpoint would hold all of it in memory.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, tuple[int, int, dict[str, Any]]] = {}  # file -> (fd, payload start, header)
        self._dir = _open_dir(self.path)  # files are opened relative to it: a rename of a parent cannot redirect them
        self.meta = read_meta(self.path, self._dir)
        self._tensors: dict[str, dict[str, Any]] = self.meta["tensors"]

    def __del__(self) -> None:
        for fd in [fd for fd, _, _ in getattr(self, "_files", {}).values()] + [getattr(self, "_dir", -1)]:
            with contextlib.suppress(OSError):
                os.close(fd)

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        entry = self._tensors.get(key)
        if entry is None:
            return None
        return tuple(entry["shape"]), getattr(torch, entry["dtype"])

    def pieces(self, key: str) -> list[tuple[str, int, int]]:
        """Ranges that cover ``key`` in order, ``(key, start, stop)`` each, as ``read`` takes them: the stored pieces,
        or, where tensor-parallel parts were stored, runs of whole rows about as large as the largest part."""
        entry = self._tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}.")
        if not any("strided" in piece for piece in entry["pieces"]):
            return [(key, piece["start"], piece["stop"]) for piece in entry["pieces"]]
        numel = max(1, math.prod(entry["shape"]))
        row = entry["pieces"][0]["strided"][2]
        largest = max(piece["stop"] - piece["start"] for piece in entry["pieces"])
        step = max(row, largest // row * row)
        return [(key, lo, min(lo + step, numel)) for lo in range(0, numel, step)]

    def _open(self, file: str) -> tuple[int, int, dict[str, Any]]:
        opened = self._files.get(file)
        if opened is None:
            fd = self._verified(file)
            length = int.from_bytes(os.pread(fd, 8, 0), "little")
            opened = self._files[file] = (fd, 8 + length, json.loads(os.pread(fd, length, 8)))
        return opened

    def _read_piece(self, file: str, name: str, lo: int, hi: int) -> Tensor:
        """Elements ``[lo, hi)`` of the stored tensor ``name`` in ``file``."""
        fd, payload, header = self._open(file)
        entry = header[name]
        dtype = _FROM_SAFETENSORS[entry["dtype"]]
        offset = payload + entry["data_offsets"][0] + lo * dtype.itemsize
        out = torch.empty((hi - lo) * dtype.itemsize, dtype=torch.uint8, device="cpu")
        view, done = memoryview(out.numpy()), 0
        while done < len(view):  # straight into the tensor's memory, no intermediate bytes
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"Checkpoint file {self.path / file} ended early while reading {name}.")
            done += got
        return out.view(dtype)

    def _verified(self, file: str) -> int:
        """A descriptor of ``file``, a regular file in the checkpoint whose size and sha256 are those meta.json lists
        (both read from the descriptor, so what was checked is what is read)."""
        path, expected, hint = self.path / file, self.meta["files"][file], _fall_back(self.path)  # listed: read_meta
        try:
            fd = open_regular(file, self._dir)
        except FileNotFoundError as err:
            raise CheckpointError(f"Checkpoint file {path} is missing. {hint}") from err
        except NotRegular as err:
            raise CheckpointError(f"Checkpoint file {path} is not a regular file (a symbolic link, say): a "
                                  f"checkpoint's files are read only from its own directory. {hint}") from err
        size = os.fstat(fd).st_size
        problem = (f"is truncated or altered: {size} bytes, expected {expected['bytes']}" if size != expected["bytes"]
                   else "is corrupt: sha256 mismatch" if sha256(fd) != expected["sha256"] else None)
        if problem is not None:
            os.close(fd)
            raise CheckpointError(f"Checkpoint file {path} {problem}. {hint}")
        return fd

    def read(self, key: str, start: int, stop: int, strided: Strided | None = None) -> Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, or of its tensor-parallel part ``strided``,
        from whichever pieces hold them."""
        entry = self._tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {key!r}.")
        if strided is not None or any("strided" in piece for piece in entry["pieces"]):
            return self._read_strided(key, entry, start, stop, strided)
        parts, cursor = [], start
        for piece in entry["pieces"]:
            lo, hi = max(cursor, piece["start"]), min(stop, piece["stop"])
            if lo >= hi:
                continue
            if lo != cursor:
                break
            parts.append(self._read_piece(piece["file"], f"{key}@{piece['start']}", lo - piece["start"],
                                          hi - piece["start"]))
            cursor = hi
            if cursor == stop:
                break
        if cursor != stop:
            raise CheckpointError(
                f"{self.path} does not hold elements [{cursor}, {stop}) of {key!r}: a rank's file is missing."
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _read_strided(self, key: str, entry: dict[str, Any], start: int, stop: int, strided: Strided | None) -> Tensor:
        """``read`` where either side is a tensor-parallel part: every overlap of the range with a piece is one
        strided block, read with one ``pread`` and copied with one strided copy."""
        out = torch.empty(stop - start, dtype=getattr(torch, entry["dtype"]))
        copied = 0
        unique = {(p["start"], p["stop"], tuple(p.get("strided", ()))): p for p in entry["pieces"]}  # (version 1 could
        for piece in unique.values():  # store a weight tied across pipeline stages twice)
            held = Strided(*piece["strided"]) if "strided" in piece else None
            name = _stored_name(key, piece["start"], held)
            for rows, cols, index, pitch, other, other_pitch in overlaps(start, stop, strided, piece["start"],
                                                                         piece["stop"], held):
                lo = other - piece["start"]
                data = self._read_piece(piece["file"], name, lo, lo + (rows - 1) * other_pitch + cols)
                out.as_strided((rows, cols), (pitch, 1), index - start).copy_(
                    data.as_strided((rows, cols), (other_pitch, 1)))
                copied += rows * cols
        if copied != stop - start:
            raise CheckpointError(f"{self.path} holds {copied} of the {stop - start} elements of {key!r} asked for: a "
                                  "rank's file is missing.")
        return out

    def full(self, key: str) -> Tensor:
        shape, _ = self.info(key) or ((), None)
        return self.read(key, 0, max(1, math.prod(shape))).reshape(shape)
