"""Bytes measured without asking the code that allocated them: the tensor storages alive, found by a sweep of the
garbage collector's objects.

``Alive()`` is entered before the work to measure; ``alive.bytes()`` is what came to life since and is still held,
each storage once (views and flat-buffer pieces share their storage), by device type. On entry every storage alive
is noted (and kept referenced until exit, so no new storage can take the address of one freed since) and the
collector's objects are frozen (``gc.freeze``): each later sweep looks only at objects made since, which keeps it
quick in a process that has made millions."""

from __future__ import annotations

import gc
from typing import Any

import torch


def _storages(objects: list[Any]) -> dict[int, Any]:
    found: dict[int, Any] = {}
    for obj in objects:
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # a fake or functional tensor (another test's trace, left for the collector)
                continue
            if storage.nbytes():
                found.setdefault(ptr, storage)
    return found


class Alive:
    """Storages that came to life inside the context (see the module's docstring)."""

    def __enter__(self) -> Alive:
        gc.collect()
        self._before = _storages(gc.get_objects())
        gc.freeze()
        return self

    def bytes(self, device_type: str | None = None) -> int:
        """The bytes of the storages alive now that were not alive on entry (on ``device_type`` only, if given)."""
        gc.collect()
        return sum(s.nbytes() for ptr, s in _storages(gc.get_objects()).items()
                   if ptr not in self._before and (device_type is None or s.device.type == device_type))

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()
        self._before = {}
