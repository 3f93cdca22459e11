"""Profilers: ``Trainer(profiler="pytorch")`` traces a few steps with torch.profiler; ``profiler="simple"`` times
every hook and the optimizer step and prints a table when fit ends."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainkit.callbacks.base import Callback

if TYPE_CHECKING:
    from trainkit.hooks import StepTiming
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


class PyTorchProfiler(Callback):
    """torch.profiler over ``active`` optimizer steps after ``wait + warmup`` of them, on every rank.

    The trace goes to ``<log_dir>/profiler/`` (``<default_root_dir>/profiler`` without a logger) as
    ``<worker>.<time>.pt.trace.json``: TensorBoard's profile plugin (``tensorboard --logdir``) and Perfetto
    (https://ui.perfetto.dev) open it. CUDA activity is recorded when the run is on a GPU.
    """

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, record_shapes: bool = False) -> None:
        if min(wait, warmup) < 0 or active < 1:
            raise ValueError(f"PyTorchProfiler needs wait, warmup >= 0 and active >= 1; got {wait}, {warmup}, "
                             f"{active}.")
        self.wait, self.warmup, self.active, self.record_shapes = wait, warmup, active, record_shapes
        self.dirpath: Path | None = None
        self._profiler: Any = None
        self._steps = 0

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        root = trainer.log_dir if trainer.log_dir is not None else trainer.default_root_dir
        self.dirpath = Path(root) / "profiler"
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities, record_shapes=self.record_shapes,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self.dirpath), worker_name=f"rank{trainer.global_rank}"),
        )
        self._profiler.__enter__()
        self._steps = 0

    def on_train_step_end(self, trainer: Trainer, module: TrainModule, timing: StepTiming) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        self._steps += 1
        if self._steps >= self.wait + self.warmup + self.active:
            self._stop()

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


class SimpleProfiler(Callback):
    """Times every hook call (module and callbacks) and each window's forward/backward and optimizer step,
    and prints a table, slowest first, on rank 0 when fit ends. The timings come from the hook dispatch,
    which the Trainer wraps when this profiler is on."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, name: str, seconds: float) -> None:
        self.totals[name] += seconds
        self.calls[name] += 1

    def timed(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.record(name, time.perf_counter() - start)

        return wrapper

    def on_train_step_end(self, trainer: Trainer, module: TrainModule, timing: StepTiming) -> None:
        self.record("forward + backward (window)", timing.forward_backward_s)
        self.record("optimizer step", timing.optimizer_s)

    def table(self) -> str:
        rows = sorted(self.totals.items(), key=lambda kv: -kv[1])
        width = max([len(k) for k, _ in rows] + [6])
        lines = [f"{'action':<{width}}  {'calls':>7}  {'total (s)':>10}  {'mean (ms)':>10}"]
        lines += [f"{name:<{width}}  {self.calls[name]:>7}  {total:>10.3f}  {total / self.calls[name] * 1e3:>10.3f}"
                  for name, total in rows]
        return "\n".join(lines)

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.is_global_zero and self.totals:
            print(self.table(), flush=True)


def make_profiler(name: str | None) -> Callback | None:
    """The callback ``Trainer(profiler=name)`` adds."""
    if name is None:
        return None
    if name == "pytorch":
        return PyTorchProfiler()
    if name == "simple":
        return SimpleProfiler()
    raise ValueError(f"Unknown profiler {name!r}; choose 'simple', 'pytorch' or None.")

