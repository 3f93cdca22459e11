"""Faults a user brings, driven through the CLI at 1 and 2 ranks: a run never loses what it saved.

A NaN or infinite loss at step k (on one rank only, at 2 ranks) stops the run with an error naming the step; the
checkpoints written before k stay intact and finite, ``latest`` names one of them, and none is written from the
non-finite state (tests/unit/test_nonfinite.py holds the rest in one process).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import accelerator_for
from trainkit.checkpoint import CheckpointReader, latest, listing
from trainkit.signals import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def trainkit(root: Path, devices: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.accelerator", accelerator_for(devices),
           "--trainer.devices", str(devices), "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
           "--trainer.default_root_dir", str(root), "--trainer.timeout_s", "60",
           "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "256", "--data.val_sequences", "32",
           "--data.batch_size", "8", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)


def all_finite(path: Path) -> bool:
    reader = CheckpointReader(path)
    return all(torch.isfinite(reader.full(key)).all() for key in reader.keys()
               if reader.info(key)[1].is_floating_point)


@pytest.mark.parametrize(("strategy", "devices", "rank", "what"), [
    ("single", 1, -1, "loss"), ("ddp", 2, 1, "loss"), ("zero2", 2, 1, "inf"),
])
def test_a_nonfinite_loss_stops_the_run_and_keeps_every_finite_checkpoint(tmp_path, strategy, devices, rank, what):
    """It used to exit 0 with every finite checkpoint pruned (save_top_k=1) or ``latest`` naming a NaN one."""
    checkpoints = tmp_path / "checkpoints"
    proc = trainkit(tmp_path, devices, "--trainer.strategy", strategy, "--trainer.callbacks+=ModelCheckpoint",
                    "--trainer.callbacks.every_n_train_steps", "1", "--trainer.max_steps", "8",
                    "--model", "tests.e2e.faulty.NonFiniteAt", "--model.rank", str(rank), "--model.step", "5",
                    "--model.what", what)
    assert proc.returncode == 1, proc.stderr[-3000:]
    value = "nan" if what == "loss" else "inf"
    where = f" on rank {rank}" if devices > 1 else ""
    assert f"The loss was {value} at step 5{where}." in proc.stderr, proc.stderr[-3000:]
    assert "epoch=0-step=4, is intact" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert latest(checkpoints).name == "epoch=0-step=4"
    assert [p.name for p in listing(checkpoints)] == ["epoch=0-step=4"]  # save_top_k=1 kept the finite one
    assert all_finite(latest(checkpoints))  # every file read, each checked against its sha256


def test_a_nonfinite_loss_on_one_rank_stops_every_rank_between_checkpoints(tmp_path):
    """Found at a logging step on rank 1 alone; the ranks agree at the next step boundary, with no save to tell."""
    proc = trainkit(tmp_path, 2, "--trainer.strategy", "ddp", "--trainer.max_steps", "40",
                    "--trainer.log_every_n_steps", "4", "--model", "tests.e2e.faulty.NonFiniteAt",
                    "--model.rank", "1", "--model.step", "6")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "The loss was nan at step 6 on rank 1." in proc.stderr, proc.stderr[-3000:]
    assert "No checkpoint was committed before the failure." in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert listing(tmp_path / "checkpoints") == []


@pytest.mark.parametrize(("args", "says"), [
    (("--trainer.limit_train_batches", "0"), "on each of the 2 ranks: the training dataloader yields no batches "
                                            "(limit_train_batches=0 leaves none of its 16 batches)"),
    (("--data", "tests.e2e.faulty.EmptyOnRank", "--data.rank", "1", "--trainer.use_distributed_sampler", "false"),
     "No training data on rank(s) 1 of 2"),
])
def test_no_training_data_is_a_configuration_error_at_two_ranks(tmp_path, args, says):
    """It used to run empty epochs forever (writing a checkpoint for each) with max_steps set."""
    proc = trainkit(tmp_path, 2, "--trainer.strategy", "ddp", "--trainer.max_steps", "5", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert listing(tmp_path / "checkpoints") == []


def test_sigterm_ends_a_run_within_seconds_when_no_step_comes(tmp_path):
    """A step that never ends (here a training_step that hangs at step 3): the signal used to wait for a boundary
    that never came. Now the run stops after the grace time (2 s here) with the preemption exit code, and the last
    committed checkpoint stays intact."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TRAINKIT_STOP_GRACE_S": "2"}
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", "10",
           "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--trainer.default_root_dir",
           str(tmp_path), "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "256",
           "--model", "tests.e2e.faulty.DiesAtStep", "--model.rank", "0", "--model.step", "2", "--model.how", "hang",
           "--model.n_layer", "1", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps",
           "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while latest_or_none(tmp_path / "checkpoints") != "epoch=0-step=2" and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # inside the hanging step
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "no optimizer step came within 2 s of SIGTERM" in stderr, stderr[-3000:]
    assert "epoch=0-step=2, is intact" in stderr
    assert took < 30, f"took {took:.0f} s"  # a hang guard: it used to wait forever
    assert latest(tmp_path / "checkpoints").name == "epoch=0-step=2"


def latest_or_none(directory: Path) -> str | None:
    pointer = directory / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_fresh_run_into_a_used_directory_leaves_it_byte_identical_at_two_ranks(tmp_path, strategy):
    base = ("--trainer.strategy", strategy, "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1")
    first = trainkit(tmp_path, 2, *base, "--trainer.max_steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    before = digests(tmp_path / "checkpoints")
    second = trainkit(tmp_path, 2, *base, "--trainer.max_steps", "2", "--model.lr", "0.01")
    assert second.returncode == 0, second.stderr[-3000:]
    assert digests(tmp_path / "checkpoints") == before
    assert [p.name for p in listing(tmp_path / "checkpoints-v1")] == ["epoch=0-step=2"]
    assert "this run writes its own to" in second.stdout


@pytest.mark.parametrize(("strategy", "writer"), [("ddp", 0), ("zero2", 1)])
def test_a_failed_write_on_one_rank_is_one_error_on_every_rank(tmp_path, strategy, writer):
    """One rank's file of the step-3 checkpoint cannot be written (ulimit -f, as a full disk fails a write): under
    ddp rank 0 writes the whole model, under zero2 rank 1 writes its shard."""
    proc = trainkit(tmp_path, 2, "--trainer.strategy", strategy, "--trainer.callbacks+=ModelCheckpoint",
                    "--trainer.callbacks.every_n_train_steps", "1", "--trainer.max_steps", "6",
                    "--model", "tests.e2e.faulty.FileLimitAt", "--model.rank", str(writer), "--model.step", "3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"trainkit: error (rank {rank}): Writing checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert f"rank {writer}: a file grew past the size limit" in proc.stderr and "[EFBIG]" in proc.stderr
    assert "epoch=0-step=2, is intact" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert latest(checkpoints).name == "epoch=0-step=2" and all_finite(latest(checkpoints))
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}
