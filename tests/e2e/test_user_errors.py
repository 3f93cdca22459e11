"""What a user sees when a run is misused from the command line: ``self.trainer`` works under ``strategy="auto"``,
whose plan traces the module's steps as fit starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cli_runs import ROOT
from tests.e2e.test_auto_strategy import ARGS, _plan
from trainkit.estimate import HEADROOM

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


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
