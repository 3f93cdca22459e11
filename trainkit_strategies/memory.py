"""Byte accounting: what a rank holds (MemoryReport) and what autograd saves for backward (ActivationMeter)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of live tensors held by this rank, per category, on the device and in host memory.

    Categories: ``params`` (working parameters), ``grads``, ``master`` (fp32 master copies kept beside
    low-precision params), ``optimizer`` (optimizer state), ``buffers``. Tensors sharing a storage are
    counted once.
    """

    device: dict[str, int]
    host: dict[str, int]

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @classmethod
    def of(cls, device: dict[str, Iterable[Tensor]], host: dict[str, Iterable[Tensor]] | None = None) -> MemoryReport:
        seen: set[object] = set()

        def count(tensors: Iterable[Tensor]) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                key = _storage_key(t)
                if key in seen:
                    continue
                seen.add(key)
                total += storage.nbytes()
            return total

        return cls({k: count(v) for k, v in device.items()}, {k: count(v) for k, v in (host or {}).items()})


def host_device(device: torch.device) -> torch.device:
    """Where a strategy computing on ``device`` keeps host memory: the CPU, or the meta device when the strategy
    is only being measured (``trainkit estimate`` sets strategies up on meta tensors)."""
    return torch.device("meta") if device.type == "meta" else torch.device("cpu")


def _storage_key(t: Tensor) -> object:
    """What identifies ``t``'s storage: its address, or, for meta and fake tensors (whose storages are all at 0:
    ``trainkit estimate`` measures strategies and traces steps without memory), the storage object itself."""
    from torch._subclasses.fake_tensor import is_fake

    storage = t.untyped_storage()
    return ("virtual", storage._cdata) if t.device.type == "meta" or is_fake(t) else storage.data_ptr()


class ActivationMeter:
    """Counts the bytes autograd saves for backward inside the context, each storage once.

    Uses ``torch.autograd.graph.saved_tensors_hooks``, so the count is deterministic and device
    independent (meta and fake tensors count their size: an estimate traces a step without memory). Under
    non-reentrant activation checkpointing the inner region's tensors are not
    saved (the checkpoint saves its inputs instead, which this meter does see). Pass the model's
    parameters as ``exclude`` to count activations only (weights saved by matmuls are not extra memory).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.bytes = 0
        self._seen: set[object] = {_storage_key(t) for t in exclude}
        self._hooks: Any = None

    def _pack(self, tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
