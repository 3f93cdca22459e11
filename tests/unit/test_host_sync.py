"""A census of host synchronisations in the default job: in the steady state an optimizer step never makes the host
wait for the device.

On a GPU, reading a device value on the host (``.item()``, ``float()``, ``bool()``, a copy to the CPU) waits for
every kernel queued before it, and a tensor built on the device from Python data (``torch.tensor(x, device=...)``)
waits for its copy from pageable memory; either stalls the pipeline of kernels once per step. The default job
(``trainkit fit``: the demo GPT, its Markov data, TensorBoard, telemetry and throughput, the progress bar) runs
here with ``meta`` standing in for the GPU (``tests/simworld.DeviceRules`` counts every host read of a device
value), and its steps are tallied one by one. Logging steps read their metrics on purpose and are left out, as is
the first step (it counts the model's FLOPs and fixes the loss normaliser); the progress bar's clock is held still,
since a census that slows every operation would otherwise see the bar refresh (read its metrics) every step where
a normal run refreshes every half second.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tests.simworld import META, DeviceRules
from trainkit import Trainer
from trainkit.callbacks import Callback
from trainkit.cli import DEMO_TRAINER
from trainkit.demo.gpt import DemoGPT
from trainkit.demo.markov import MarkovData
from trainkit_strategies import Environment

PACKAGES = tuple(str(Path(__file__).resolve().parents[2] / name) for name in ("trainkit", "trainkit_strategies"))
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


class PythonDataOnDevice(TorchFunctionMode):
    """Tensors that trainkit's code builds on the device from Python data (a copy the host waits for)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FROM_DATA:
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
            device = kwargs.get("device", args[0].device if func is torch.Tensor.new_tensor else None)
            caller = sys._getframe(1).f_code.co_filename
            if not isinstance(data, torch.Tensor) and device is not None and torch.device(device) == META \
                    and caller.startswith(PACKAGES):
                self.calls.append(f"{caller}:{sys._getframe(1).f_lineno} {func.__name__}")
        return func(*args, **kwargs)


class Tally(Callback):
    """Host reads and device tensors from Python data, per optimizer step (everything from one batch's start to the
    next one's: the step and every callback's work after it)."""

    def __init__(self, rules: DeviceRules, built: PythonDataOnDevice) -> None:
        self.rules, self.built = rules, built
        self.steps: dict[int, list] = {}
        self._seen = (0, 0)

    def _close(self, step: int) -> None:
        reads, built = len(self.rules.host_reads), len(self.built.calls)
        self.steps[step] = self.rules.host_reads[self._seen[0]:] + self.built.calls[self._seen[1]:]
        self._seen = (reads, built)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step:
            self._close(trainer.global_step)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._close(trainer.global_step)


def test_the_default_job_never_waits_for_the_device_between_logging_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(Environment, "resolve_device", staticmethod(lambda accelerator, local_rank=0: META))
    monkeypatch.setattr("trainkit.callbacks.progress.time.monotonic", lambda: 0.0)
    rules, built = DeviceRules(), PythonDataOnDevice()
    tally = Tally(rules, built)
    settings = {**DEMO_TRAINER, "max_steps": 30}  # the default job's (logging every 25 steps)
    trainer = Trainer(**settings, default_root_dir=tmp_path, enable_checkpointing=False, callbacks=[tally])
    assert trainer.strategy.device == META and trainer.loggers and trainer.log_every_n_steps == 25
    with built, rules:  # checkpoints are written at epoch and run ends, not in the steps counted here
        trainer.fit(DemoGPT(max_steps=30), datamodule=MarkovData(train_sequences=2048))
    assert sorted(tally.steps) == list(range(1, 31))
    # the first step sets up; the logging step (25) and the end of fit (30) read what the steps left on the device
    steady = {step: found for step, found in tally.steps.items() if 1 < step < 30 and step % 25}
    assert len(steady) == 27
    assert all(not found for found in steady.values()), {s: f for s, f in steady.items() if f}
    assert tally.steps[25], "the logging step reads its metrics: the census sees host reads"


def test_the_census_sees_a_tensor_built_from_python_data_and_a_host_read():
    """Guards the test above: the pre-fix normaliser (``torch.as_tensor(count, device=...)``) and a loss read."""
    rules, built = DeviceRules(), PythonDataOnDevice()
    step_file = str(Path(PACKAGES[0]) / "step.py")
    code = compile("float(torch.as_tensor(4, dtype=torch.float64, device=device))", step_file, "eval")
    with built, rules:
        eval(code, {"torch": torch, "device": META})
    assert built.calls == [f"{step_file}:1 as_tensor"]
    assert [kind for kind, _ in rules.host_reads] == ["item"]
