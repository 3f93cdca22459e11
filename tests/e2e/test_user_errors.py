"""What a user sees when a run is stopped or misused from the command line: Ctrl-C is one line and exit code 130 at
any world size, with the checkpoint to resume from; ``self.trainer`` works under ``strategy="auto"``, whose plan
traces the module's steps as fit starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cli_runs import ROOT
from tests.e2e.test_auto_strategy import ARGS, _plan
from tests.helpers import accelerator_for
from trainkit.estimate import HEADROOM

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _sigint_by_default() -> None:
    """A child started from a background job inherits SIGINT ignored, and Python then raises no KeyboardInterrupt:
    a terminal's Ctrl-C reaches a foreground program with the default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("devices", "whom"), [(1, "process"), (2, "group"), (2, "rank0")])
def test_ctrl_c_during_fit_is_one_line_and_exit_code_130(tmp_path, devices, whom):
    """SIGINT once the first checkpoint is committed, as a terminal's Ctrl-C sends it (to the whole process group:
    every rank) or as ``kill -INT`` to rank 0 alone (its peer learns of it through the failed collective): one line
    from rank 0 naming the step and the intact checkpoint, no traceback from any rank, exit code 130."""
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.devices", str(devices), "--trainer.accelerator",
           accelerator_for(devices), "--trainer.strategy", "ddp" if devices > 1 else "single",
           "--trainer.max_steps", "100000", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
           "--trainer.timeout_s", "60", "--trainer.callbacks+=ModelCheckpoint",
           "--trainer.callbacks.every_n_train_steps", "3", "--trainer.default_root_dir", str(tmp_path),
           "--data.train_sequences", "256", "--data.val_sequences", "16", "--data.batch_size", "4"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_sigint_by_default)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)
            time.sleep(0.2)
        time.sleep(1.0)
        if whom == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    said = err.strip().splitlines()  # no traceback, nor a peer's error: the one line
    assert len(said) == 1 and said[0].startswith("trainkit: interrupted after step "), err[-3000:]
    latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text()
    assert f"The last committed checkpoint, {latest}, is intact: resume with --ckpt_path last" in said[0], said


def test_self_trainer_works_in_every_hook_under_strategy_auto_at_2_ranks(tmp_path):
    """strategy="auto" at 2 ranks plans on a meta copy of the module as fit starts, tracing ``training_step`` and
    building its optimizer: ``self.trainer`` there is the run's Trainer, as in every other hook (it raised "is not
    attached to a Trainer"). With room for tp=2's plan alone, the loader that ``estimated_stepping_batches`` asked
    for while the planner's 2 data-parallel ranks held the run is sharded again for the layout's one: both ranks
    read the same batches."""
    plan = _plan()
    layout, one_axis = plan.row("tp2"), min(r.peak for r in plan.rows if not r.options)
    reads, batches = tmp_path / "reads", tmp_path / "batches"
    proc = subprocess.run(
        [sys.executable, "-m", "trainkit.cli", "fit", *ARGS, "--trainer.default_root_dir", str(tmp_path),
         "--trainer.device_memory", str(int((layout.peak + one_axis) / 2 / HEADROOM)),
         "--model", "tests.e2e.probes.ReadsTrainer", "--model.path", str(reads),
         "--trainer.callbacks+=tests.e2e.probes.BatchProbe", "--trainer.callbacks.path", str(batches)],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy='auto': parallel (tp2)" in proc.stdout, proc.stdout[-2000:]
    for rank in range(2):
        seen = json.loads(Path(f"{reads}.rank{rank}.json").read_text())
        assert seen == [["configure_optimizers", 2, 2], ["training_step", 2, 0], ["training_step", 2, 1]], seen
    read = [json.loads(Path(f"{batches}.rank{rank}.json").read_text()) for rank in range(2)]
    assert len(read[0]) == 2 and read[0] == read[1], read
