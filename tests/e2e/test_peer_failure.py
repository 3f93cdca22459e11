"""A rank that dies, raises or hangs: the others stop with a clear error within the timeout, and the
last committed checkpoint stays intact and resumable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import accelerator_for
from trainkit.checkpoint import CheckpointReader

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "--trainer.accelerator", accelerator_for(2), "--trainer.devices", "2", "--trainer.strategy", "ddp",
    "--trainer.enable_progress_bar", "false",
    "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "640", "--data.val_sequences", "64",
    "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps", "10",
    "--trainer.max_steps", "20", "--trainer.logger", "false",
]


def run(root: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "fit", *COMMON, "--trainer.default_root_dir",
                           str(root), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    return proc, time.monotonic() - start


@pytest.mark.parametrize(("how", "timeout_s", "names"), [
    ("kill", 60, ""), ("raise", 60, "rank 1 failed (RuntimeError: injected failure)"),
    ("hang", 10, "rank 1 has been in DiesAtStep.training_step at step 15 for"),
    # frozen: gloo alone would wait timeout_s (600 s) as NCCL does for a dead peer; the heartbeat notices in seconds
    ("freeze", 600, "rank 1 stopped answering: no heartbeat for"),
])
def test_failed_peer_stops_the_run_with_a_clear_error(tmp_path, how, timeout_s, names):
    proc, elapsed = run(tmp_path, "--model", "tests.e2e.faulty.DiesAtStep", "--model.how", how,
                        "--model.step", "15", "--trainer.timeout_s", str(timeout_s), "--trainer.peer_timeout_s", "5")
    assert proc.returncode != 0
    assert "A collective across 2 ranks failed" in proc.stderr, proc.stderr[-3000:]
    assert names in proc.stderr, proc.stderr[-3000:]
    assert "is intact: resume with --ckpt_path last" in proc.stderr
    # a hang guard, not a timing: without the heartbeat a frozen rank holds the others for timeout_s (600 s); when a
    # silence counts as a death is tests/unit/test_ticking.py's, on a clock the test moves
    limit = 60 + 2 * timeout_s if how != "freeze" else 180
    assert elapsed < limit, f"took {elapsed:.0f} s"
    latest = tmp_path / "checkpoints" / "epoch=0-step=10"
    assert (tmp_path / "checkpoints" / "latest").read_text() == latest.name
    assert CheckpointReader(latest).meta["loop"]["global_step"] == 10
    resumed, _ = run(tmp_path, "--ckpt_path", "last", "--trainer.timeout_s", "60")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "epoch=1-step=20"


@pytest.mark.parametrize("stuck", [1, 0])
def test_a_rank_stuck_in_its_training_step_is_named_and_the_run_ends_within_timeout_s(tmp_path, stuck):
    """The stuck rank's heartbeat goes on, so only timeout_s ends the others' wait: they warn half-way, then stop
    naming its rank, step and phase, and the stuck rank (rank 0 too, the launcher, which nobody would stop) ends itself.
    Before, they waited out timeout_s with no name, and a stuck rank 0 slept on (the subprocess timeout here)."""
    proc, elapsed = run(tmp_path, "--model", "tests.e2e.faulty.DiesAtStep", "--model.how", "hang",
                        "--model.rank", str(stuck), "--model.step", "2",
                        "--trainer.timeout_s", "8", "--trainer.peer_timeout_s", "5", timeout=150)
    other = 1 - stuck
    doing = f"rank {stuck} has been in DiesAtStep.training_step at step 2 for"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"trainkit: warning (rank {other}): {doing}" in proc.stderr, proc.stderr[-3000:]
    assert f"trainkit: error (rank {other}): A collective across 2 ranks failed: {doing}" in proc.stderr
    assert "while the other ranks waited for it (timeout_s=8)" in proc.stderr
    assert f"trainkit: error (rank {stuck}): {doing}" in proc.stderr  # the stuck rank's own last words
    assert "No checkpoint was committed before the failure." in proc.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"  # start-up, two steps, timeout_s (8 s), the stuck rank's grace


def test_a_peer_seconds_late_is_no_failure(tmp_path):
    """gloo closes a connection whose wait timed out: the heartbeat's one-second checks must not cut the survivors'
    waits (zero2's reduce-scatter, a ring of point-to-point rounds on gloo, waits 3 s for rank 1 here)."""
    proc, _ = run(tmp_path, "--model", "tests.e2e.faulty.DiesAtStep", "--model.how", "late", "--model.step", "15",
                  "--trainer.strategy", "zero2",
                  "--trainer.timeout_s", "60", "--trainer.peer_timeout_s", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "epoch=1-step=20"


DIES_BEFORE_JOINING = '''
import os
import trainkit as tk

if os.environ.get("RANK") == "1":
    raise ImportError("simulated: a package is missing on rank 1")
if __name__ == "__main__":
    tk.Trainer(devices=2, accelerator="cpu", logger=False, timeout_s=600)
    print("joined")
'''


def test_a_rank_that_dies_before_joining_stops_rank_zero_at_once(tmp_path):
    """Rank 0 does not wait timeout_s (600 s here) for a launched rank that is already dead."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_BEFORE_JOINING)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "joined" not in proc.stdout
    assert "rank 1 exited with code 1 before joining the other ranks" in proc.stderr, proc.stderr[-3000:]
    assert "simulated: a package is missing" in proc.stderr
    assert time.monotonic() - start < 180  # a hang guard: rank 0 would otherwise wait timeout_s, 600 s


def test_devices_from_python_c_says_to_use_a_script(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "import trainkit as tk; tk.Trainer(devices=2, accelerator='cpu', logger=False)"
    proc = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert "cannot be re-run. Put the training code in a script" in proc.stderr, proc.stderr[-3000:]
