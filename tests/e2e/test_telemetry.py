"""Telemetry in TensorBoard (communication, time, memory), and the profilers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import trainkit as tk
from tests.e2e.cli_runs import ROOT, scalars
from tests.helpers import Regression, accelerator_for, loader, regression_data


@pytest.mark.slow
def test_the_demo_logs_comm_time_and_memory_and_comm_equals_comm_stats(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.devices", "2", "--trainer.accelerator",
           accelerator_for(2), "--trainer.strategy", "zero2", "--trainer.max_steps", "6",
           "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.timeout_s", "120",
           "--trainer.callbacks+=tests.e2e.probes.CommProbe", "--trainer.callbacks.path", str(tmp_path / "comm.json"),
           "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "640",
           "--data.val_sequences", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probed = {int(k): v for k, v in json.loads((tmp_path / "comm.json").read_text()).items()}
    for kind in ("reduce_scatter", "all_gather", "all_reduce"):
        logged = scalars(tmp_path, f"comm/{kind}_bytes")
        assert sorted(logged) == list(range(1, 7)), kind
        assert all(logged[step] == probed[step][kind] for step in logged), (kind, logged, probed)
    assert min(scalars(tmp_path, "comm/reduce_scatter_bytes").values()) > 0
    for tag in ("time/forward_backward_ms", "time/optimizer_ms", "time/comm_wait_ms", "memory/rss_mb",
                "throughput/samples_per_sec", "throughput/tflops_per_device"):
        values = scalars(tmp_path, tag)
        assert sorted(values) == list(range(1, 7)) and all(v >= 0 for v in values.values()), tag
    assert min(scalars(tmp_path, "time/forward_backward_ms").values()) > 0
    assert min(scalars(tmp_path, "memory/rss_mb").values()) > 50


def test_the_pytorch_profiler_writes_a_trace(tmp_path):
    trainer = tk.Trainer(max_steps=6, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         profiler="pytorch")
    trainer.fit(Regression(), loader(regression_data(64), 4))
    traces = list((trainer.log_dir / "profiler").glob("*.pt.trace.json"))
    assert len(traces) == 1, list((trainer.log_dir / "profiler").iterdir())
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("ProfilerStep#" in str(e.get("name")) for e in events)  # three profiled steps, after warm-up


def test_the_simple_profiler_prints_hook_and_step_times(tmp_path, capsys):
    trainer = tk.Trainer(max_steps=4, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         profiler="simple")
    trainer.fit(Regression(), loader(regression_data(32), 4))
    out = capsys.readouterr().out
    assert "optimizer step" in out and "forward + backward (window)" in out
    assert "ModelCheckpoint.on_train_end" in out
    assert trainer.profiler.calls["optimizer step"] == 4


def test_throughput_counts_model_flops_once_and_logs_mfu_against_the_given_peak(tmp_path):
    dim, hidden, batch = 8, 16, 4
    throughput = tk.callbacks.ThroughputMonitor(peak_flops=1e9)
    trainer = tk.Trainer(max_steps=4, log_every_n_steps=1, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[throughput])
    trainer.fit(Regression(dim, hidden), loader(regression_data(64, dim), batch))
    # mlp: Linear(dim, hidden), Linear(hidden, 1): 2mn forward each; backward 2mn for each weight gradient, and
    # 2mn more for the input gradient of the second layer only (the batch needs none)
    assert throughput.flops_per_sample == 2 * dim * hidden * 2 + 2 * hidden * 3
    for tag in ("throughput/samples_per_sec", "throughput/tflops_per_device", "throughput/mfu"):
        assert sorted(scalars(tmp_path, tag)) == [1, 2, 3, 4], tag
    last = throughput.last
    assert abs(last["throughput/mfu"] - last["throughput/tflops_per_device"] * 1e12 / 1e9) < 1e-6
    # one replica: the rank's FLOP/s are its samples/s times the FLOPs per sample
    flops = last["throughput/tflops_per_device"] * 1e12
    assert abs(flops - last["throughput/samples_per_sec"] * throughput.flops_per_sample) < 1e-6 * flops


def test_the_module_can_give_its_flops_per_sample(tmp_path):
    class Counted(Regression):
        def flops_per_sample(self) -> float:
            return 1234.0

    throughput = tk.callbacks.ThroughputMonitor()
    trainer = tk.Trainer(max_steps=2, log_every_n_steps=1, enable_progress_bar=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[throughput])
    trainer.fit(Counted(), loader(regression_data(32), 4))
    assert throughput.flops_per_sample == 1234.0 and throughput._counter is None
    assert ("throughput/mfu" in throughput.last) == (throughput.peak_flops is not None)  # no peak known on a CPU
    assert throughput.last["throughput/tflops_per_device"] > 0
