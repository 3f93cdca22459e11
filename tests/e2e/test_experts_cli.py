"""examples/moe.py from the command line with its experts divided over two ranks (``--trainer.strategy parallel
--trainer.strategy.ep 2``): TensorBoard gets ``train_loss``, the balance loss and the tokens each expert took; the
checkpoint exports whole experts (every layer's stacked weights as one process holds them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from tests.e2e.cli_runs import ROOT, scalars
from tests.helpers import accelerator_for

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)


def test_examples_moe_trains_with_expert_parallelism_and_logs_the_routers(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    small = ["--model.n_layers", "2", "--model.dim", "32", "--model.hidden_dim", "32", "--model.experts", "4",
             "--model.max_seq_len", "32", "--data.block_size", "32", "--data.batch_size", "4"]
    fit = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "moe.py"), "fit", "--data.path", str(text), "--trainer.devices", "2",
         "--trainer.accelerator", accelerator_for(2), "--trainer.strategy", "parallel", "--trainer.strategy.ep", "2",
         "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1", "--trainer.timeout_s", "120",
         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path), *small],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-4000:]
    assert len(scalars(tmp_path, "train_loss")) == 4
    balance = scalars(tmp_path, "moe/balance_loss")
    assert len(balance) == 4 and all(1.0 <= v < 4.0 for v in balance.values())  # 1 balanced, 4 all on one expert
    tokens = [scalars(tmp_path, f"moe/tokens/expert{e}") for e in range(4)]
    # every assignment of the step's tokens counted once: 2 layers x 4 x 32 tokens x top 2, averaged over 2 ranks
    assert sum(t[1] for t in tokens) == pytest.approx(2 * 4 * 32 * 2)
    out = tmp_path / "export"
    export = subprocess.run([sys.executable, "-m", "trainkit.cli", "export", str(tmp_path / "checkpoints"), str(out)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert export.returncode == 0, export.stderr[-3000:]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("model.layers.0.moe.w1").get_shape()) == [4, 32, 32]  # all four experts
