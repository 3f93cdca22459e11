"""strategy="auto" on several ranks: the fastest strategy whose planned memory fits the device, chosen when fit
starts and said in one line; none fitting is an error naming the smallest plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.e2e.cli_runs import ROOT
from tests.helpers import accelerator_for
from trainkit.demo.gpt import DemoGPT
from trainkit.demo.markov import MarkovData
from trainkit.estimate import HEADROOM, estimate, first_batch

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

ARGS = ["--trainer.devices", "2", "--trainer.accelerator", accelerator_for(2), "--trainer.max_steps", "2",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--trainer.timeout_s", "120",
        "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "256", "--data.val_sequences", "32"]


def _plan():
    with torch.device("meta"):
        module = DemoGPT()
    data = MarkovData(train_sequences=256, val_sequences=32)
    data.setup("fit")
    return estimate(module, first_batch(data.train_dataloader()), world_size=2,
                    strategies=["ddp", "zero1", "zero2", "fsdp", "zero_offload"])


def _fit(tmp_path, memory: int, *more: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "trainkit.cli", "fit", *ARGS, "--trainer.default_root_dir",
                           str(tmp_path), "--trainer.device_memory", str(memory), *more], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)


def test_auto_picks_a_sharded_strategy_when_ddp_does_not_fit(tmp_path):
    plan = _plan()
    ddp, zero1 = plan.row("ddp").peak, plan.row("zero1").peak
    assert zero1 < ddp
    memory = int((ddp + zero1) / 2 / HEADROOM)  # room for zero1's plan, not for ddp's
    proc = _fit(tmp_path, memory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy='auto': zero1, the fastest plan that fits" in proc.stdout, proc.stdout[-2000:]
    from trainkit.checkpoint import CheckpointReader, latest

    assert CheckpointReader(latest(tmp_path / "checkpoints")).meta["strategy"] == "zero1"


def test_auto_with_nothing_fitting_names_the_smallest_plan(tmp_path):
    plan = _plan()
    smallest = min(plan.rows, key=lambda r: r.peak)
    proc = _fit(tmp_path, smallest.peak // 4)
    assert proc.returncode != 0
    assert "No strategy fits in" in proc.stderr, proc.stderr[-3000:]
    assert f"the smallest plan is {smallest.describe_choice()}" in proc.stderr, proc.stderr[-3000:]


def test_auto_takes_a_tensor_parallel_layout_when_no_one_axis_strategy_fits(tmp_path):
    """The demo GPT declares a tensor-parallel plan: with room for tp=2's plan and for no one-axis strategy's, auto
    trains under strategy="parallel" with tp=2 (and says so), its two ranks reading the same batches (the loader is
    sharded by the chosen layout's data-parallel ranks, one here, not by the two ranks that planned)."""
    plan = _plan()
    layout = plan.row("tp2")
    one_axis = min(r.peak for r in plan.rows if not r.options)
    assert layout.options == {"tp": 2, "pp": 1} and layout.peak < one_axis
    probe = str(tmp_path / "batches")
    proc = _fit(tmp_path, int((layout.peak + one_axis) / 2 / HEADROOM),
                "--trainer.callbacks+=tests.e2e.probes.BatchProbe", "--trainer.callbacks.path", probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy='auto': parallel (tp2), the fastest plan that fits" in proc.stdout, proc.stdout[-2000:]
    from trainkit.checkpoint import CheckpointReader, latest

    assert CheckpointReader(latest(tmp_path / "checkpoints")).meta["strategy"] == "parallel"
    seen = [json.loads((tmp_path / f"batches.rank{r}.json").read_text()) for r in range(2)]
    assert len(seen[0]) == 2 and seen[0] == seen[1], seen


def test_auto_under_checkpointing_says_the_size_it_decided_with(tmp_path):
    """With activation checkpointing the plan that fits is measured with checkpointed activations, and the line
    says that size (it said the uncheckpointed one)."""
    from trainkit.demo.gpt import Block
    from trainkit.estimate import human

    with torch.device("meta"):
        module = DemoGPT()
    data = MarkovData(train_sequences=256, val_sequences=32)
    data.setup("fit")
    plan = estimate(module, first_batch(data.train_dataloader()), world_size=2, activation_checkpointing=[Block],
                    strategies=["ddp", "zero1", "zero2", "fsdp", "zero_offload"])
    ddp = plan.row("ddp")
    assert ddp.need(True) != ddp.need(False)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "fit", *ARGS, "--trainer.default_root_dir",
                           str(tmp_path), "--trainer.device_memory", str(10 * ddp.need(False)),
                           "--trainer.activation_checkpointing", "[trainkit.demo.gpt.Block]"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"strategy='auto': ddp, the fastest plan that fits: {human(ddp.need(True))} per rank" in proc.stdout, \
        proc.stdout[-2000:]
