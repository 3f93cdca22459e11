"""torchrun restarts a failed group and trainkit resumes it: a rank killed with SIGKILL mid-run, the group
restarted by ``--max-restarts 1``, and every step's loss and the final parameters equal an uninterrupted
run's (within 1e-6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.cli_runs import ROOT, tensors

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

SCRIPT = ROOT / "tests" / "e2e" / "elastic_train.py"


def torchrun(root: Path, strategy: str, kill_step: int) -> subprocess.CompletedProcess:
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.2",
           str(SCRIPT), strategy, str(root), str(kill_step)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(root: Path, rank: int) -> tuple[dict[int, float], set[int]]:
    """The last loss recorded for each step (a restart re-runs the steps after the checkpoint), and the
    attempts that recorded any."""
    by_step, attempts = {}, set()
    for line in (root / f"losses-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]
        attempts.add(record["attempt"])
    return by_step, attempts


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_torchrun_restart_resumes_the_killed_run_exactly(tmp_path, strategy):
    torchrun(tmp_path / "straight", strategy, kill_step=0)
    torchrun(tmp_path / "killed", strategy, kill_step=7)  # checkpoints at 2, 4, 6: the restart resumes at 6
    for rank in (0, 1):
        want, _ = losses(tmp_path / "straight", rank)
        got, attempts = losses(tmp_path / "killed", rank)
        assert attempts == {0, 1}, "the group was not restarted"
        assert sorted(got) == sorted(want) == list(range(1, 13))
        torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]),
                                   torch.tensor([want[s] for s in sorted(want)]), rtol=0, atol=1e-6)
    final = "epoch=0-step=12"
    want_state, got_state = tensors(tmp_path / "straight" / "checkpoints" / final), \
        tensors(tmp_path / "killed" / "checkpoints" / final)
    assert want_state.keys() == got_state.keys() and any(k.startswith("optim/") for k in want_state)
    for key in want_state:
        torch.testing.assert_close(got_state[key], want_state[key], rtol=0, atol=1e-6, msg=key)
