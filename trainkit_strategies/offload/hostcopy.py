"""Host memory for offloaded state, and the copies between it and the device.

On a GPU (ZeRO-Offload, Ren et al., 2021, §4) what crosses the bus goes in bulk (a bucket at a time, in the
compute dtype, never converting dtype across the bus), asynchronously (on a side stream, so backward and the next
bucket's reduce-scatter go on), and from page-locked memory (a copy from pageable memory makes the host wait).
Buffers that never cross the bus (fp32 master weights, Adam's moments) are ordinary host memory.

torch's pinned allocator rounds every request up to a power of two: the 10.8 GB bf16 gradient partition of a 5.4B
model would take 17.2 GB. ``host_buffer`` allocates exactly what is asked and page-locks it with
``cudaHostRegister`` instead (what ``torch.distributed.checkpoint`` does for its staging buffers), unregistering
it when its storage is freed.

``CopyStream`` runs copies on a CUDA side stream ordered by events; on any other device (the CPU, or ``meta``
standing in for a GPU in tests and in ``trainkit estimate``) copies run inline and every event is already
complete, so the same code drives both.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from trainkit_strategies.planning.memory import page_locked, plan_host

if TYPE_CHECKING:
    from trainkit_strategies.communication.environment import Environment


def host_buffer(numel: int, dtype: torch.dtype, env: Environment, pinned: bool = False) -> Tensor:
    """``numel`` zeroed elements of host memory for a strategy running in ``env``; ``pinned``: page-locked when the
    device is a CUDA GPU (for copies that overlap compute), at exactly this size."""
    tensor = torch.zeros(numel, dtype=dtype, device=env.host)
    if pinned and env.device.type == "cuda" and numel:
        _page_lock(tensor)
    if pinned and env.host_is_separate:
        page_locked.add(tensor.untyped_storage())
    if env.host.type == "meta":
        plan_host(tensor)
    return tensor


def _page_lock(tensor: Tensor) -> None:
    cudart = torch.cuda.cudart()
    pointer, size = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    error = int(cudart.cudaHostRegister(pointer, size, 0))
    if error:
        raise RuntimeError(f"cudaHostRegister of {size} bytes of host memory failed with cudaError {error}; the "
                           "machine may limit locked memory (ulimit -l).")
    weakref.finalize(tensor.untyped_storage(), cudart.cudaHostUnregister, pointer)


def is_page_locked(tensor: Tensor) -> bool:
    """Whether ``tensor`` is in page-locked host memory (pinned by torch, or registered by ``host_buffer``)."""
    return tensor.device.type == "cpu" and torch.cuda.is_available() and tensor.is_pinned()


def mark(device: torch.device) -> Any:
    """An event after the work queued so far on ``device``'s current stream (``None`` off CUDA: nothing pends)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def synchronize(device: torch.device) -> None:
    """Wait on the host for the work queued on ``device``'s current stream (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class CopyStream:
    """Copies beside compute: on CUDA a side stream, its copies ordered after the compute queued before them and
    marked by events; elsewhere they run inline, and events are ``None`` (complete)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def side(self, after_current: bool = True) -> Iterator[None]:
        """Run the copies issued inside on the side stream, after everything queued on the current stream (or, with
        ``after_current=False``, after what the side stream already holds only: the caller has made sure on the host
        that what the copies read and overwrite is ready)."""
        if self.stream is None:
            yield
            return
        if after_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def mark(self) -> Any:
        """An event after the work queued so far on the current stream (inside ``side``: the side stream)."""
        return mark(self.device)

    @staticmethod
    def wait(event: Any) -> None:
        """The current stream waits for ``event`` (the host does not)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    @staticmethod
    def synchronize(event: Any) -> None:
        """The host waits for ``event``."""
        if event is not None:
            event.synchronize()
