"""ZeRO-Offload (Ren et al., 2021): ZeRO stage 2 with the fp32 master weights, the Adam moments and the
gradient partition in host memory, and the optimizer step on the host.

Per bucket, as backward completes it: one reduce-scatter, one bulk non-blocking copy of the reduced
compute-dtype gradients to pinned host memory on a side stream (``OffloadedGradients``, in
``zero.py``); the step then runs torch's fused CPU Adam chunk by chunk, converting each chunk of
gradient in cache and writing each chunk of the updated master back in the compute dtype
(``host_adam.py``), and one bulk copy per bucket brings the parameters back. The device holds the
working parameters, gradient buckets in flight and activations: 2 bytes a parameter plus buckets,
against 16 without offload (§3).

Clipping and the fp16 overflow check need the global gradient norm, which exists only once the last
bucket is reduced; the step waits for it (the copies and the conversion do not), so clipping and
loss scaling behave exactly as without offload.

``delayed_update`` is ZeRO-Offload's one-step delayed parameter update (DPU, §4.2): the host step of
step t runs in the background while the device computes step t+1's forward and backward, which
therefore use the parameters of step t-1. It takes the host step off the critical path at the price of
one step of staleness: the numbers differ from synchronous training (the paper starts it after a few
hundred steps of warm-up; here it is on from the first step, or off).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.data_parallel.zero import Zero2Strategy
from trainkit_strategies.flat import FlatBucket
from trainkit_strategies.hostcopy import CopyStream, host_buffer
from trainkit_strategies.memory import MemoryReport
from trainkit_strategies.precision import Precision


class ZeroOffloadStrategy(Zero2Strategy):
    """ZeRO-Offload: stage 2 with master weights, optimizer state and gradients on the host.

    Args:
        bucket_mb: bucket size in MiB for reduce-scatter / all-gather (and the unit of host transfers).
        offload: keep it True (False is plain zero2).
        ratio: the fraction of each group's optimizer state kept on the host (the rest steps on the device).
        delayed_update: run each host step in the background, overlapping the next step's forward and
            backward, which then see parameters one step old (ZeRO-Offload's DPU; changes the numbers).
        broadcast_buffers: broadcast rank 0's floating-point buffers after every step, as ddp does.
        reduce_dtype: dtype gradients are reduce-scattered, copied to the host and accumulated in; default: the
            compute dtype (see ``zero2``).
    """

    name = "zero_offload"

    def __init__(self, bucket_mb: float = 25.0, offload: bool = True, ratio: float = 1.0,
                 delayed_update: bool = False, broadcast_buffers: bool = True, reduce_dtype: str | None = None) -> None:
        super().__init__(bucket_mb, offload, ratio, broadcast_buffers, reduce_dtype)
        if delayed_update and not offload:
            raise ValueError("zero_offload delayed_update needs offload=True: it delays the host step.")
        self.delayed_update = delayed_update
        self._pending: Future | None = None
        self._spare: list[Tensor] = []
        self._worker: ThreadPoolExecutor | None = None

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        self._settle_step()
        super().setup(module, optimizer, precision)
        if optimizer is not None and self.delayed_update:  # the host step runs beside the next step's compute
            self._master.host_workers = 1
            self._master.retarget(optimizer)
        if optimizer is not None and self.delayed_update:
            self._master.add_low_buffers(precision.working_dtype)  # the step must not write the params in use
            self._spare = [host_buffer(b.numel(), b.dtype, self.env, pinned=True) for b in self.grads.buffers]
            self._worker = self._worker or ThreadPoolExecutor(1, thread_name_prefix="trainkit-offload-step")

    def optimizer_step(self) -> None:
        if not self.delayed_update:
            super().optimizer_step()
            return
        assert self.optimizer is not None and self._worker is not None
        self._settle_step()  # step t-1 is done: its parameters go to the device before step t starts
        grads, self.grads.buffers, self._spare = self.grads.buffers, self._spare, self.grads.buffers
        mult = self._take_grad_mult()

        def piece(bucket: FlatBucket) -> Tensor:
            return grads[bucket.group][bucket.shard_start : bucket.shard_start + bucket.piece]

        def step(uploaded: Any) -> None:
            CopyStream.synchronize(uploaded)  # the last step's parameters have left the buffers this step rewrites
            self._master.step(self.optimizer, piece, mult)

        self._pending = self._worker.submit(step, self._uploaded)
        self.sync_buffers()

    def _settle_step(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._gather_working()

    def settle(self) -> None:
        self._settle_step()

    def state_layout(self) -> st.StateLayout:
        self._settle_step()
        return super().state_layout()

    def full_parameters(self) -> dict[str, Tensor]:
        self._settle_step()
        return super().full_parameters()

    def memory_report(self) -> MemoryReport:
        self._settle_step()
        report = super().memory_report()
        spare = sum(t.untyped_storage().nbytes() for t in self._spare)  # page-locked, as the partition it swaps with
        pinned = spare if self.env.host_is_separate else 0
        host = {**report.host, "grads": report.host["grads"] + spare}
        return MemoryReport(report.device, host, report.pinned + pinned)

    def teardown(self) -> None:
        self._settle_step()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        super().teardown()
