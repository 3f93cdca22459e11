"""The README's default run: `trainkit fit` learns the Markov corpus to within 0.1 nats of its entropy rate."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)


def test_default_run_reaches_the_entropy_floor(tmp_path):
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"validation loss ([\d.]+) nats \| Markov entropy floor H = ([\d.]+) nats", proc.stdout)
    assert match, proc.stdout[-2000:]
    val_loss, entropy = float(match.group(1)), float(match.group(2))
    print(proc.stdout.strip().splitlines()[-1])
    assert val_loss - entropy < 0.1
    assert (tmp_path / "checkpoints" / "latest").is_file()
