"""Streaming export of a checkpoint's model to safetensors files Hugging Face tools read.

A universal checkpoint holds each parameter as ranges ("pieces") spread over the ranks' files. Export
writes the model's full tensors (the fp32 masters, names as in ``named_parameters()``, persistent
buffers too) to ``model.safetensors``, or to shards of at most ``max_shard_size`` bytes with a
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map": {name: file}}``).

Nothing is assembled in memory: the safetensors header is computed from the checkpoint's table of
shapes and dtypes, then every piece is copied straight to its byte offset in the output, so peak
memory is one piece, however large the model (DeepSpeed's ``zero_to_fp32`` needs the whole model in
RAM).

Export writes only inside ``out`` and never through a link: every file is created under a fresh temporary name with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and renamed over its final name, so a symbolic link planted there (``out/
model.safetensors -> ~/.bashrc``, say) is replaced, not written through. ``out`` itself is the user's to choose, a
link included.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from trainkit.checkpoint import CheckpointError, CheckpointReader, safetensors_header
from trainkit.resume import checkpoint_in

_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes in ``size``: an int, or a string such as "5GB", "500MB", "2GiB" (Hugging Face's convention)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"Cannot read the size {size!r}; write it like 5GB, 500MB or 2GiB.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _plan(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int | None,
          ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Tensors, in order, grouped into shards of at most ``max_shard_size`` bytes (a larger tensor alone)."""
    if max_shard_size is None:
        return [entries]
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


@contextlib.contextmanager
def _created(path: Path) -> Iterator[BinaryIO]:
    """A new file that becomes ``path`` once written and made durable; what ``path`` was (a link too) is replaced."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_shard(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], reader: CheckpointReader,
                 source: dict[str, str]) -> int:
    """Write one safetensors file, piece by piece at computed offsets; returns its payload bytes."""
    header, offsets = safetensors_header(entries)
    size = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)
    with _created(path) as f:
        f.write(header)
        f.truncate(len(header) + size)
        for name, _, dtype in entries:
            base = len(header) + offsets[name]
            for key, lo, hi in reader.pieces(source[name]):
                data = reader.read(key, lo, hi).to(dtype).contiguous()
                f.seek(base + lo * dtype.itemsize)
                f.write(data.view(torch.uint8).numpy().data)  # the tensor's bytes, not a copy of them
    return size


def export(checkpoint: str | Path, out: str | Path, max_shard_size: str | int | None = None,
           dtype: str | None = None, submodule: str | None = None) -> list[Path]:
    """Write the model of ``checkpoint`` (a checkpoint directory, or one holding a ``latest`` pointer) into
    the directory ``out``; returns the files written.

    Args:
        max_shard_size: split into ``model-0000i-of-0000n.safetensors`` files of at most this size (bytes, or
            "5GB"-style) plus ``model.safetensors.index.json``; None writes one ``model.safetensors``.
        dtype: "fp32", "bf16" or "fp16" to convert floating-point tensors; None keeps the stored dtypes.
        submodule: export only this submodule of the TrainModule (``"gpt"`` for ``self.gpt = GPT2LMHeadModel(...)``),
            its tensors named as in the submodule itself, with its configuration as ``config.json`` when it has one
            (a Hugging Face model's ``config``, recorded in the checkpoint): what ``from_pretrained`` loads.
    """
    path = checkpoint_in(Path(checkpoint))
    assert path is not None
    reader = CheckpointReader(path)
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype must be one of {sorted(_DTYPE_NAMES)}; got {dtype!r}.")
    prefix = f"model/{submodule}." if submodule else "model/"
    entries, source = [], {}
    for key in reader.keys():
        if not key.startswith(prefix):
            continue
        info = reader.info(key)
        assert info is not None
        shape, stored = info
        target = _DTYPE_NAMES[dtype] if dtype is not None and stored.is_floating_point else stored
        name = key.removeprefix(prefix)
        entries.append((name, shape, target))
        source[name] = key
    if not entries and submodule:
        tops = sorted({k.removeprefix("model/").split(".")[0] for k in reader.keys() if k.startswith("model/")})
        raise CheckpointError(f"{path} holds no tensors of a submodule {submodule!r}; its model's top-level "
                              f"submodules are: {', '.join(tops)}.")
    if not entries:
        raise CheckpointError(f"{path} holds no model tensors to export.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    config = reader.meta.get("configs", {}).get(submodule or "")
    if config is not None:
        with _created(out / "config.json") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True).encode())
        written.append(out / "config.json")
    shards = _plan(entries, parse_size(max_shard_size) if max_shard_size is not None else None)
    if len(shards) == 1 and max_shard_size is None:
        target = out / "model.safetensors"
        _write_shard(target, shards[0], reader, source)
        return [target, *written]
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, start=1):
        target = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(target, shard, reader, source)
        weight_map |= {name: target.name for name, _, _ in shard}
        files.append(target)
    index = out / "model.safetensors.index.json"
    with _created(index) as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
    return [*files, index, *written]
