"""Byte accounting: what a rank holds (MemoryReport) and what autograd saves for backward (ActivationMeter)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of live tensors held by this rank, per category, on the device and in host memory.

    Categories: ``params`` (working parameters), ``grads``, ``master`` (fp32 master copies kept beside
    low-precision params), ``optimizer`` (optimizer state), ``buffers``. Tensors sharing a storage are
    counted once. ``pinned``: the part of the host bytes that is page-locked (what crosses the bus under offload).
    ``storages``: those counted on the device, by identity (what a planner checks the model as built against).
    """

    device: dict[str, int]
    host: dict[str, int]
    pinned: int = 0
    storages: frozenset = field(default=frozenset(), compare=False, repr=False)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @classmethod
    def of(cls, device: dict[str, Iterable[Tensor]], host: dict[str, Iterable[Tensor]] | None = None) -> MemoryReport:
        seen: set[object] = set()
        pinned = 0

        def count(tensors: Iterable[Tensor], on_host: bool = False) -> int:
            nonlocal pinned
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                key = _storage_key(t)
                if key in seen:
                    continue
                seen.add(key)
                total += storage.nbytes()
                if on_host and storage in page_locked:
                    pinned += storage.nbytes()
            return total

        device_bytes = {k: count(v) for k, v in device.items()}
        on_device = frozenset(seen)
        host_bytes = {k: count(v, on_host=True) for k, v in (host or {}).items()}
        return cls(device_bytes, host_bytes, pinned, on_device)


page_locked: weakref.WeakSet = weakref.WeakSet()  # storages of host buffers page-locked for the bus (hostcopy.py)
planned_host: weakref.WeakSet = weakref.WeakSet()  # host storages of strategies planned on the meta device


class LiveBytes(TorchDispatchMode):
    """The most bytes alive at once in storages created on ``device`` while active (meta and fake tensors count their
    size; a storage resized to nothing counts nothing), leaving out host memory planned on the meta device
    (``planned_host``): what a strategy's setup holds on the device at its peak, measured by ``trainkit estimate``
    on meta tensors; with ``host``, that host memory only. Tensors that existed before are not counted, nor the
    storages ``existing`` names (by ``_storage_key``) when an operation returns a view of one.

    The total is kept as it changes, not summed anew at every operation (which cost half of planning a large model):
    a storage counts from the operation that made it until it dies; an operation's outputs are measured again (an
    in-place resize); a resize outside the dispatcher goes through ``resize_storage`` and host memory planned on the
    meta device through ``plan_host``, both of which tell the meters running."""

    def __init__(self, device: torch.device, host: bool = False, existing: frozenset = frozenset()) -> None:
        super().__init__()
        self.device = device
        self.host = host
        self.existing = existing
        self.peak = 0
        self._total = 0
        self._counted: dict[object, tuple[weakref.ref, int]] = {}  # storage key -> (the storage, the bytes counted)

    def measure(self, t: Tensor) -> None:
        """Counts ``t``'s storage as it is now (a new storage from now on, a known one at its current size)."""
        storage, key = t.untyped_storage(), _storage_key(t)
        if key in self.existing:
            return
        ref, counted = self._counted.get(key, (None, 0))
        if ref is None or ref() is not storage:  # new (or a dead storage's address reused)
            ref, counted = weakref.ref(storage, partial(self._died, key)), 0
        now = storage.nbytes() if (storage in planned_host) == self.host else 0
        self._total += now - counted
        self._counted[key] = (ref, now)

    def _died(self, key: object, ref: weakref.ref) -> None:
        entry = self._counted.get(key)
        if entry is not None and entry[0] is ref:
            self._total -= entry[1]
            del self._counted[key]

    def __enter__(self) -> LiveBytes:
        _meters.append(self)
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.peak = max(self.peak, self._total)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.device.type == self.device.type:
                self.measure(t)
        return out

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, self._total)
        _meters.remove(self)
        super().__exit__(*exc)


_meters: list[LiveBytes] = []  # the LiveBytes meters running, innermost last


def resize_storage(t: Tensor, nbytes: int) -> None:
    """``t.untyped_storage().resize_(nbytes)``, told to the running meters (a resize is no operation they see)."""
    t.untyped_storage().resize_(nbytes)
    for meter in _meters:
        if _storage_key(t) in meter._counted:
            meter.measure(t)


def plan_host(t: Tensor) -> None:
    """Marks ``t``'s storage as host memory planned on the meta device: not the device's, so no meter counts it."""
    planned_host.add(t.untyped_storage())
    for meter in _meters:
        if _storage_key(t) in meter._counted:
            meter.measure(t)


def _storage_key(t: Tensor) -> object:
    """What identifies ``t``'s storage: its address, or, for meta and fake tensors (whose storages are all at 0:
    ``trainkit estimate`` measures strategies and traces steps without memory), the storage object itself."""
    from torch._subclasses.fake_tensor import is_fake

    storage = t.untyped_storage()
    return ("virtual", storage._cdata) if t.device.type == "meta" or is_fake(t) else storage.data_ptr()


def _storage_id(t: Tensor) -> int:
    """The storage object itself (its address in memory): the same across a resize, so parameters that are views
    of a buffer gathered and freed again (FSDP units) stay excluded after it is gathered anew. Every storage counted
    or excluded is alive while a meter runs, so no two share this."""
    return t.untyped_storage()._cdata


_unkept = threading.local()  # .depth: how many ``partial_products()`` contexts this thread is inside


@contextmanager
def partial_products() -> Iterator[None]:
    """Marks the matrix products computed inside as partial sums about to be reduced (a row-parallel layer's):
    full-size, never read by backward once reduced, so selective activation checkpointing recomputes them instead
    of keeping them (``trainkit/activation.py``). Kept, they would cost a whole ``s x b x h`` per product on every
    tensor-parallel rank, more than the rank's whole share of the layer's other activations at large ``tp``."""
    _unkept.depth = getattr(_unkept, "depth", 0) + 1
    try:
        yield
    finally:
        _unkept.depth -= 1


def in_partial_products() -> bool:
    """Whether this thread is computing products ``partial_products()`` marks."""
    return getattr(_unkept, "depth", 0) > 0


class ActivationMeter:
    """Counts the bytes autograd saves for backward inside the context, each storage once.

    Uses ``torch.autograd.graph.saved_tensors_hooks``, so the count is deterministic and device
    independent (meta and fake tensors count their size: an estimate traces a step without memory). Under
    non-reentrant activation checkpointing the inner region's tensors are not
    saved (the checkpoint saves its inputs instead, which this meter does see); under selective checkpointing
    the outputs it keeps are counted too (``note_saved``). Pass the model's
    parameters as ``exclude`` to count activations only (weights saved by matmuls are not extra memory).
    """

    _local = threading.local()  # .meters: those entered on this thread (ranks simulated as threads count apart)

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.bytes = 0
        self._seen: set[object] = {_storage_id(t) for t in exclude}
        self._hooks: Any = None

    @classmethod
    def note_saved(cls, tensor: Tensor) -> None:
        """Count ``tensor`` as saved for backward in every active meter: for what is kept outside autograd's
        saved-tensor hooks (selective checkpointing's stored outputs)."""
        for meter in getattr(cls._local, "meters", ()):
            meter._pack(tensor)

    def _pack(self, tensor: Tensor) -> Tensor:
        key = _storage_id(tensor)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        if not hasattr(ActivationMeter._local, "meters"):
            ActivationMeter._local.meters = []
        ActivationMeter._local.meters.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        ActivationMeter._local.meters.remove(self)
        self._hooks.__exit__(*exc)
