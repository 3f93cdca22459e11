"""What a checkpoint reader trusts in a directory it did not write: regular files, named plainly, inside it.

A checkpoint directory may be shared, copied or edited by others, and meta.json's sha256 shows corruption, not
intent (anyone can recompute it). So every name the reader opens (the ``latest`` pointer's, meta.json's ``files`` and
each piece's ``file``) must be a plain name: no separator, no ``..``, not absolute. Each is opened relative to the
directory's descriptor with ``O_NOFOLLOW`` and checked to be a regular file on the opened descriptor itself, before
anything about it is compared or said: its size and hash are read from that descriptor (no second lookup a swap could
redirect), and a refusal says nothing about what a link points at, not even whether it exists.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a planted pipe must not block


class NotRegular(OSError):
    """The name is a symbolic link, a directory, a pipe or a device: not a file a checkpoint holds."""


def plain_name(name: Any) -> bool:
    """Whether ``name`` names an entry of a directory itself: not empty, ``.`` or ``..``, no separator or NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def open_regular(name: str, dir_fd: int) -> int:
    """A read-only descriptor of the regular file ``name`` in the directory ``dir_fd``; ``NotRegular`` when it is
    anything else (a symbolic link is not followed), ``FileNotFoundError`` when it is not there."""
    try:
        fd = os.open(name, _OPEN, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotRegular(errno.ELOOP, "not a regular file", name) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, "not a regular file", name)
    return fd


def holds_file(path: Path, name: str) -> bool:
    """Whether ``path`` is a directory (not a link to one) holding a regular file ``name`` (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(path / name).st_mode)
    except OSError:
        return False


def open_dir(path: Path) -> int:
    """A descriptor of the directory ``path`` (a link given as ``path`` is followed: the user chose it)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def read_name(directory: Path, name: str) -> str | None:
    """The one plain name the small file ``name`` in ``directory`` holds (a pointer such as ``latest``), None where
    there is no such file; ``ValueError`` saying what it holds instead (which never reads through a link)."""
    try:
        dir_fd = open_dir(directory)
    except OSError:
        return None
    try:
        with os.fdopen(open_regular(name, dir_fd), "rb") as f:
            raw = f.read(4097)
    except FileNotFoundError:
        return None
    except NotRegular:
        raise ValueError("is not a regular file (a symbolic link, say)") from None
    finally:
        os.close(dir_fd)
    try:
        text = raw.decode().strip()
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None
    if not text:
        raise ValueError("is empty")
    if not plain_name(text) or any(c in text for c in "\n\r") or len(raw) > 4096:
        raise ValueError(f"holds {text[:200]!r}, which is not the name of a checkpoint in {directory}")
    return text


def sha256(fd: int) -> str:
    """The sha256 of the whole file open at ``fd`` (read with ``pread``: its offset is left alone)."""
    digest, offset = hashlib.sha256(), 0
    while block := os.pread(fd, 1 << 22, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def table_problem(meta: dict[str, Any], dtypes: set[str]) -> str | None:
    """What is wrong with meta.json's table of files and tensors, naming the entry (None when nothing is): every
    field the reader relies on present and of its type, every file a plain name, every piece's file listed, every
    dtype one of ``dtypes``."""
    files, tensors = meta.get("files"), meta.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        return "its 'files' or 'tensors' table is missing"
    for name, entry in files.items():
        if not plain_name(name):
            return f"files names {name!r}, which is not a plain file name inside the checkpoint directory"
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _count(entry.get("bytes"))):
            return f"files[{name!r}] lacks its sha256 or size"
    for key, entry in tensors.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and all(map(_count, entry["shape"]))
                and entry.get("dtype") in dtypes and isinstance(entry.get("pieces"), list)):
            return f"tensors[{key!r}] lacks a valid shape, dtype or list of pieces"
        for i, piece in enumerate(entry["pieces"]):
            where = f"tensors[{key!r}].pieces[{i}]"
            if not isinstance(piece, dict):
                return f"{where} is not a piece"
            if not plain_name(piece.get("file")):
                return f"{where}.file is {piece.get('file')!r}, which is not a plain file name inside the checkpoint " \
                       "directory"
            if piece["file"] not in files:
                return f"{where}.file {piece['file']!r} is not listed under files"
            if not (_count(piece.get("start")) and _count(piece.get("stop")) and piece["start"] <= piece["stop"]):
                return f"{where} lacks a valid start and stop"
            strided = piece.get("strided")
            if strided is not None and not (isinstance(strided, list) and len(strided) == 3
                                            and all(map(_count, strided)) and min(strided[1:]) > 0):
                return f"{where}.strided is not an origin, a block and a stride"
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
