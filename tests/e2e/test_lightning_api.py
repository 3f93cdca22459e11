"""The Lightning API around a run, at 2 ranks: ``load_from_checkpoint`` of what ddp, zero3 and fsdp wrote, the module's
``self.logger.experiment`` on every rank. One process: tests/unit/test_lightning_module_api.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.cli_runs import ROOT
from tests.helpers import Regression

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

FIT_SCRIPT = '''
import sys
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader
import trainkit as tk
from tests.helpers import accelerator_for, regression_data
from tests.unit.test_lightning_module_api import Drawing

if __name__ == "__main__":
    torch.set_num_threads(1)
    strategy, root = sys.argv[1], sys.argv[2]
    module = Drawing(hidden=24, lr=0.05)
    trainer = tk.Trainer(devices=2, accelerator=accelerator_for(2), strategy=strategy, max_steps=5,
                         default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                         timeout_s=120, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(regression_data(64), batch_size=8))
    final = {name: p.detach().float().cpu().clone() for name, p in trainer.strategy.full_parameters().items()}
    if trainer.is_global_zero:
        save_file(final, f"{root}/final.safetensors")
'''


def _run(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "run.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _events(run: Path) -> Any:
    events = EventAccumulator(str(run), size_guidance={"histograms": 0, "images": 0})
    events.Reload()
    return events


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_load_from_checkpoint_of_a_2_rank_run_holds_the_trainer_s_final_parameters(tmp_path, strategy):
    _run(tmp_path, FIT_SCRIPT, strategy, str(tmp_path))
    final = load_file(tmp_path / "final.safetensors")
    loaded = Regression.load_from_checkpoint(tmp_path / "checkpoints")
    assert loaded.hparams.hidden == 24 and loaded.hparams.lr == 0.05
    got = dict(loaded.named_parameters())
    assert got.keys() == final.keys()
    for name, want in final.items():
        torch.testing.assert_close(got[name].detach(), want, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    reference = Regression(hidden=24)
    reference.load_state_dict(final)
    x = torch.randn(6, 8)
    torch.testing.assert_close(loaded.eval()(x), reference.eval()(x), rtol=0, atol=0)
    assert not torch.equal(final["net.0.weight"], Regression(hidden=24).net[0].weight.detach())  # it trained

    # the module drew through self.logger.experiment on both ranks; rank 0 alone wrote, into the run's directory
    runs = tmp_path / "runs" / "trainkit"
    assert [p.name for p in runs.iterdir()] == ["version_0"]
    events = _events(runs / "version_0")
    assert [e.step for e in events.Histograms("inputs")] == [0, 1, 2, 3, 4]
    assert [e.step for e in events.Images("picture")] == [0, 1, 2, 3, 4]
    writers = [p for p in (runs / "version_0").iterdir() if p.name.startswith("events.") and
               not p.name.endswith(".trainkit")]
    assert len(writers) == 1, writers  # one SummaryWriter, rank 0's
