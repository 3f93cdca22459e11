"""ZeRO-Offload (Ren et al., 2021): ZeRO stage 2 with the fp32 master weights, the Adam moments and the
gradient partition in host memory, and the optimizer step on the host.

Per bucket, as backward completes it: one reduce-scatter, one bulk non-blocking copy of the reduced
compute-dtype gradients to pinned host memory on a side stream (``OffloadedGradients``, in ``zero.py``). The host
step is one pass per run of buckets on every core (``host_adam.py``): gradient in the compute dtype, master and
moments in fp32, the updated parameters written over the gradient in the compute dtype, from where one bulk copy
per bucket takes them back to the device. Host memory then holds 12 bytes a parameter of master and moments and 2
of gradient partition, nothing else that grows with the model (``memory_report`` counts it). The device holds the
working parameters, gradient buckets in flight and activations: 2 bytes a parameter plus buckets, against 16
without offload (§3).

A bucket's step does not depend on any other bucket's, so when nothing global gates the step (no clipping by norm,
no fp16 overflow check: the Trainer says so through ``step_in_backward``) each bucket steps on a host thread as soon
as its gradient lands, while backward goes on with the next buckets, and its parameters go back right after: the
step is mostly hidden behind backward (§4.3 overlaps only the copies; this overlaps the update too). With clipping
or loss scaling the step waits for the global norm, then runs the same passes bucket by bucket.

``delayed_update`` is ZeRO-Offload's one-step delayed parameter update (DPU, §4.2): the host step of
step t runs in the background while the device computes step t+1's forward and backward, which
therefore use the parameters of step t-1. It takes the host step off the critical path at the price of
one step of staleness: the numbers differ from synchronous training (the paper starts it after a few
hundred steps of warm-up; here it is on from the first step, or off).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.capabilities import StepsInBackward
from trainkit_strategies.data_parallel.gradients import OffloadedGradients
from trainkit_strategies.data_parallel.zero import Zero2Strategy
from trainkit_strategies.offload.hostcopy import CopyStream, host_buffer, mark
from trainkit_strategies.planning.memory import MemoryReport
from trainkit_strategies.precision import Precision
from trainkit_strategies.state import pieces as st
from trainkit_strategies.state.flat import FlatBucket


class ZeroOffloadStrategy(StepsInBackward, Zero2Strategy):
    """ZeRO-Offload: stage 2 with master weights, optimizer state and gradients on the host.

    Args:
        bucket_mb: bucket size in MiB for reduce-scatter / all-gather (and the unit of host transfers).
        offload: keep it True (False is plain zero2).
        ratio: the fraction of each group's optimizer state kept on the host; the rest, the buckets backward produces
            last (which the next forward needs first), steps on the device.
        overlap_step: step each bucket on the host as soon as its gradients land, during backward, when nothing needs
            the gradients before the step (the Trainer decides: no clipping, no fp16 loss scaling, no
            ``on_before_optimizer_step`` hook). None (default): where the device is not the host (a GPU), whose
            backward leaves the host's cores idle; True: on a CPU device too, where the host step and backward share
            the cores (it pays when backward waits for other ranks, not otherwise); False: always after backward.
        delayed_update: run each host step in the background, overlapping the next step's forward and
            backward, which then see parameters one step old (ZeRO-Offload's DPU; changes the numbers).
        broadcast_buffers: broadcast rank 0's floating-point buffers after every step, as ddp does.

    Gradients are reduce-scattered, copied to the host and accumulated in the precision policy's ``grad_dtype``
    (see ``zero2``).
    """

    name = "zero_offload"
    manual_optimization = False  # its host step may run during the window's last backward

    def __init__(self, bucket_mb: float = 25.0, offload: bool = True, ratio: float = 1.0,
                 overlap_step: bool | None = None, delayed_update: bool = False,
                 broadcast_buffers: bool = True) -> None:
        super().__init__(bucket_mb, offload, ratio, broadcast_buffers)
        if delayed_update and not offload:
            raise ValueError("zero_offload delayed_update needs offload=True: it delays the host step.")
        self.overlap_step, self.delayed_update = overlap_step, delayed_update
        self._pending: Future | None = None
        self._spare: list[Tensor] = []
        self._worker: ThreadPoolExecutor | None = None
        self._overlapping: Future | None = None  # the host step running during backward: its last task
        self.steps_in_backward = 0  # optimizer steps taken during backward so far

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        self._settle_step()
        super().setup(module, optimizer, precision)
        if optimizer is not None and self.delayed_update:
            self._master.add_low_buffers(precision.working_dtype)  # the step must not write the params in use
            self._spare = [host_buffer(b.numel(), b.dtype, self.env, pinned=True) for b in self.grads.buffers]

    # -- the step during backward --------------------------------------------------------------------
    def step_in_backward(self, scale: float | Tensor) -> bool:
        overlap = self.env.host_is_separate if self.overlap_step is None else self.overlap_step
        if not (overlap and isinstance(self.grads, OffloadedGradients) and self._master.adam is not None
                and not self.delayed_update and self._syncing):
            return False
        grads = self.grads
        if isinstance(scale, Tensor) and scale.device.type == "cuda":  # read on the host once the device has it
            scale = torch.empty((), dtype=scale.dtype, device="cpu", pin_memory=True).copy_(scale, non_blocking=True)
            ready = mark(self.device)
        else:
            ready = None
        threads = max(1, self._master.threads - 1)  # one core drives backward
        self._overlapping = grads.submit(self._begin_host_step, scale, ready, threads)
        self.steps_in_backward += 1
        return True

    def _host_threads(self) -> int | None:
        return max(1, torch.get_num_threads() - 1) if self.delayed_update else None  # beside the next forward

    def _begin_host_step(self, scale: float | Tensor, ready: Any, threads: int) -> None:
        CopyStream.synchronize(ready)
        self._master.start_host_step(float(scale), threads)

    def gradient_landed(self, bucket: FlatBucket, landed: Any) -> None:
        if self._overlapping is None or bucket.index not in self._master.on_host:
            return
        self._overlapping = self.grads.submit(self._step_landed, bucket, landed)  # type: ignore[attr-defined]

    def _step_landed(self, bucket: FlatBucket, landed: Any) -> None:
        if isinstance(landed, Future):
            landed.result()  # an accumulation add, which waited for its copy
        else:
            CopyStream.synchronize(landed)
        self._master.host_ready(bucket, self.grads.piece(bucket), self._working_piece(bucket))

    def reduce_gradients(self, scale: float | Tensor) -> None:
        if self._overlapping is not None:
            self._master.widen()  # backward is over: the runs left take every core
        super().reduce_gradients(scale)
        if self._overlapping is not None:  # every bucket has landed: step what waits for a longer run
            self._overlapping = self.grads.submit(self._master.finish_host_step)  # type: ignore[attr-defined]

    def optimizer_step(self) -> None:
        if self._overlapping is not None:
            done, self._overlapping = self._overlapping, None
            done.result()  # the host step has run (and raises here if it failed)
            mult = self._take_grad_mult()
            device = {b.index: self.grads.piece(b) for b in self.buckets if b.index not in self._master.on_host}
            self._master.step_device(self.optimizer, device, mult)  # type: ignore[arg-type]
            self._gather_working()
            self.sync_buffers()
            return
        if not self.delayed_update:
            super().optimizer_step()
            return
        assert self.optimizer is not None
        self._worker = self._worker or ThreadPoolExecutor(1, thread_name_prefix="trainkit-offload-step")
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

    def zero_grad(self) -> None:
        if self._overlapping is not None:  # a window closed without its step: let the host step finish, unused
            self._overlapping.result()
            self._overlapping = None
        super().zero_grad()

    # -- the delayed update --------------------------------------------------------------------------
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
        return replace(report, host=host, pinned=report.pinned + pinned)

    def teardown(self) -> None:
        self._settle_step()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        super().teardown()
