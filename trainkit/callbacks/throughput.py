"""ThroughputMonitor: samples/s, items/s (tokens, say) and model FLOPs utilisation over each logging interval."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainkit.callbacks.base import Callback
from trainkit.utils import infer_batch_size

if TYPE_CHECKING:
    from trainkit.hooks import StepTiming
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer

# dense peak FLOP/s per device (vendor datasheets, SXM parts, without sparsity), matched against
# torch.cuda.get_device_name: (16-bit tensor cores, TF32 tensor cores or None, fp32 without tensor cores)
PEAK_FLOPS = {
    "H200": (989.4e12, 494.7e12, 66.9e12),
    "H100": (989.4e12, 494.7e12, 66.9e12),
    "A100": (312e12, 156e12, 19.5e12),
    "L40S": (362.05e12, 183e12, 91.6e12),
    "A10G": (125e12, 62.5e12, 31.2e12),
    "V100": (125e12, None, 15.7e12),  # fp16 tensor cores; no TF32
}


class ThroughputMonitor(Callback):
    """Logs, at every ``log_every_n_steps``-th optimizer step, rates over the wall time since the previous log:

    - ``throughput/samples_per_sec`` and, when steps return ``num_items``, ``throughput/items_per_sec``, over
      all data-parallel replicas (this rank's rate times their number);
    - ``throughput/tflops_per_device``: this rank's model FLOPs (forward and backward) per second, and
      ``throughput/mfu``, that over the device's peak, when the peak is known.

    Model FLOPs per sample come from the module's ``flops_per_sample`` (a number, or a method returning one),
    or else are counted once, over the first optimizer step, with ``torch.utils.flop_counter``'s formulas
    (matrix products, convolutions, attention). Recomputation under activation checkpointing is counted too,
    so the figure is then nearer hardware FLOPs utilisation. Under ``pipeline`` a rank counts its own stage.

    Args:
        batch_size_fn: batch -> number of samples (default: leading dimension of the first tensor).
        peak_flops: the device's peak FLOP/s for ``throughput/mfu``; by default, for the GPUs in ``PEAK_FLOPS``, the
            dense peak of what the run's matrix products use: 16-bit tensor cores, TF32 tensor cores for fp32 when
            ``torch.get_float32_matmul_precision()`` allows them (``Trainer(float32_matmul_precision=...)``), or
            plain fp32; none on a CPU.
        count_flops: count model FLOPs when the module does not give them.
    """

    def __init__(self, batch_size_fn: Callable[[Any], int] | None = None, peak_flops: float | None = None,
                 count_flops: bool = True) -> None:
        self.batch_size_fn = batch_size_fn or infer_batch_size
        self.peak_flops, self.count_flops = peak_flops, count_flops
        self.flops_per_sample: float | None = None
        self._samples = 0
        self._items: Any = 0.0
        self._t0 = 0.0
        self._counter: Any = None
        self.last: dict[str, float] = {}

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._t0 = time.perf_counter()
        self._samples, self._items = 0, 0.0
        given = getattr(module, "flops_per_sample", None)
        self.flops_per_sample = float(given() if callable(given) else given) if given is not None else None
        if self.peak_flops is None:
            self.peak_flops = peak_flops_of(trainer.strategy.device, trainer.precision.working_dtype)
        if self.flops_per_sample is None and self.count_flops:
            self._counter = FlopCount()  # until the first optimizer step closes
            self._counter.__enter__()

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._samples += self.batch_size_fn(batch)
        if isinstance(outputs, Mapping) and outputs.get("num_items") is not None:
            self._items = self._items + outputs["num_items"]  # a tensor stays on device until logged

    def on_train_step_end(self, trainer: Trainer, module: TrainModule, timing: StepTiming) -> None:
        step = trainer.global_step
        if self._counter is not None:
            flops = self._stop_counting()
            self.flops_per_sample = flops / self._samples if flops and self._samples else None
        if step % trainer.log_every_n_steps != 0:
            return
        now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        replicas = trainer.strategy.dp_size
        self.last = {"throughput/samples_per_sec": self._samples * replicas / elapsed}
        if float(self._items):
            self.last["throughput/items_per_sec"] = float(self._items) * replicas / elapsed
        if self.flops_per_sample:
            achieved = self.flops_per_sample * self._samples / elapsed
            self.last["throughput/tflops_per_device"] = achieved / 1e12
            if self.peak_flops:
                self.last["throughput/mfu"] = achieved / self.peak_flops
        trainer.log_metrics(self.last, step)
        self._samples, self._items, self._t0 = 0, 0.0, now

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._stop_counting()

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        self._stop_counting()

    def _stop_counting(self) -> int:
        counter, self._counter = self._counter, None
        if counter is None:
            return 0
        counter.__exit__(None, None, None)
        return counter.total


def peak_flops_of(device: torch.device, dtype: torch.dtype, name: str | None = None,
                  matmul_precision: str | None = None) -> float | None:
    """The dense peak FLOP/s of ``device`` (a GPU named ``name``, in ``PEAK_FLOPS``) for matrix products in
    ``dtype``: fp32 products run on TF32 tensor cores only when the fp32 matmul precision (``matmul_precision``,
    default torch's setting) is "high" or "medium" and the GPU has them."""
    if device.type != "cuda" and name is None:
        return None
    name = name if name is not None else torch.cuda.get_device_name(device)
    matmul_precision = matmul_precision or torch.get_float32_matmul_precision()
    for model, (half, tf32, fp32) in PEAK_FLOPS.items():
        if model in name:
            if dtype in (torch.bfloat16, torch.float16):
                return half
            return tf32 if tf32 is not None and matmul_precision != "highest" else fp32
    return None


class FlopCount(TorchDispatchMode):
    """Adds up the FLOPs of the operations ``torch.utils.flop_counter`` has formulas for (matrix products,
    convolutions, attention), forward and backward, while active. Unlike ``FlopCounterMode`` it tracks no modules:
    the backward hooks that needs cannot run inside the ``autograd.grad`` calls of a zero-bubble pipeline."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.formulas = flop_registry
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out
