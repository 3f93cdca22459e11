"""A rank's setup at its peak, as a run that builds the model on the meta device and materialises only what the rank
keeps holds it (issue 44): measured on meta tensors by ``trainkit estimate`` (``SetupMeter``), never by a formula of a
strategy's name.

Such a run allocates nothing for the model as built. It allocates what the rank keeps of it, straight on its device,
and computes (or reads from a file) each tensor the rank keeps any part of one whole tensor at a time, in the dtype it
was built in, before cutting the rank's part out. So, per rank:

- device: the built tensors the strategy still holds after setup, from the start, plus the most bytes its setup
  allocates on the device at once (pieces, flat buffers, fp32 masters, gradient buckets);
- host: the largest whole tensor the rank rebuilds (any built tensor the setup reads or keeps), plus the most host
  memory the setup allocates at once (offload's buffers).

Where the device is the CPU both are one memory, and each figure is their sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainkit_strategies.planning.memory import LiveBytes, MemoryReport, _storage_key


@dataclass(frozen=True)
class SetupPeak:
    """One rank's setup at its peak (bytes)."""

    device: int  # what the rank keeps of the model as built, and what its setup allocates on the device at once
    host: int  # the largest whole tensor it rebuilds, and what its setup allocates in host memory at once
    largest: int  # that largest whole tensor alone, in the dtype it was built in


class _Reads(TorchDispatchMode):
    """Which of ``built``'s storages an operation reads (a slice cut out, a copy into a flat buffer, a dtype cast)."""

    def __init__(self, built: dict[object, int]) -> None:
        super().__init__()
        self.built = built
        self.read: set[object] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and t.device.type == "meta":
                key = _storage_key(t)
                if key in self.built:
                    self.read.add(key)
        return func(*args, **(kwargs or {}))


class SetupMeter:
    """Measures a strategy's ``setup`` of ``model`` (built on the meta device) on meta tensors: enter it around the
    setup, then ask ``peak`` with what the strategy reports it holds (its ``memory_report()`` right after setup).
    ``separate_host``: whether the run's host memory is apart from its device's (a GPU's)."""

    def __init__(self, model: nn.Module, device: torch.device, separate_host: bool) -> None:
        tensors = [*model.parameters(), *model.buffers()]
        self._built = {_storage_key(t): t.untyped_storage().nbytes() for t in tensors}
        # an axis's part of a tensor (tensor parallelism's slice) is cut from the whole, rebuilt or read whole
        self._whole = {_storage_key(t): getattr(t, "_trainkit_part", (t,))[0].untyped_storage().nbytes()
                       for t in tensors}
        # their storages held, so that none made later takes a key of theirs (a parameter's ``.data`` is replaced)
        self._alive = [t.untyped_storage() for t in tensors]
        self._device = LiveBytes(device, existing=frozenset(self._built))
        self._host = LiveBytes(device, host=True, existing=frozenset(self._built))
        self._reads = _Reads(self._built)
        self.separate_host = separate_host

    def __enter__(self) -> SetupMeter:
        self._reads.__enter__()
        self._host.__enter__()
        self._device.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._device.__exit__(*exc)
        self._host.__exit__(*exc)
        self._reads.__exit__(*exc)

    def peak(self, held: MemoryReport | Iterable[Tensor]) -> SetupPeak:
        """The peak, given what the rank holds after setup (a report's ``storages``, or the tensors themselves)."""
        storages = held.storages if isinstance(held, MemoryReport) else {_storage_key(t) for t in held}
        kept = {key for key in self._built if key in storages}
        largest = max((self._whole[key] for key in kept | self._reads.read), default=0)
        device = self._device.peak + sum(self._built[key] for key in kept)
        host = self._host.peak + largest
        if not self.separate_host:
            device = host = device + host
        return SetupPeak(device, host, largest)
