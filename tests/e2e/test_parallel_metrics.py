"""torchmetrics under tensor parallelism: the tensor-parallel ranks of one data-parallel coordinate read the same
samples, so a metric synced over the whole world would count each of them tp times. A count of the validation
sequences seen is the number there are, under tp2 (nothing to sync) and tp2 x dp_shard2 (synced over dp)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch import Tensor
from torchmetrics import SumMetric

from tests.e2e.cli_runs import ROOT, scalars
from tests.helpers import accelerator_for
from trainkit.demo.gpt import DemoGPT

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

VAL_SEQUENCES = 24


class CountingGPT(DemoGPT):
    """The demo GPT counting the validation sequences it sees, logged as a torchmetrics object."""

    def configure_model(self) -> None:
        super().configure_model()
        self.seen = SumMetric()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.seen.update(batch[0].shape[0])
        self.log("val_seen", self.seen, on_epoch=True)


LAYOUTS = [(2, ["--trainer.strategy.tp", "2"]),
           (4, ["--trainer.strategy.tp", "2", "--trainer.strategy.dp_shard", "2"])]


@pytest.mark.parametrize(("devices", "options"), LAYOUTS, ids=["tp2", "tp2-dp_shard2"])
def test_a_metric_counts_each_sample_once(tmp_path, devices, options):
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--model", "tests.e2e.test_parallel_metrics.CountingGPT",
           "--model.n_layer", "2", "--trainer.accelerator", accelerator_for(devices), "--trainer.devices",
           str(devices), "--trainer.strategy", "parallel", *options, "--trainer.max_steps", "2",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
           "--trainer.timeout_s", "120", "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "8",
           "--data.val_sequences", str(VAL_SEQUENCES), "--data.batch_size", "4"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = scalars(tmp_path, "val_seen")
    assert seen and all(v == VAL_SEQUENCES for v in seen.values()), seen


def _fit(tmp_path, devices: int, options: list[str]) -> dict[int, float]:
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--model.n_layer", "2", "--trainer.accelerator",
           accelerator_for(devices), "--trainer.devices", str(devices), *options, "--trainer.max_steps", "4",
           "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path),
           "--trainer.enable_progress_bar", "false", "--trainer.timeout_s", "120", "--trainer.limit_val_batches", "0",
           "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "32", "--data.val_sequences", "8",
           "--data.batch_size", "4"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tmp_path.mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return scalars(tmp_path, "train_loss")


def test_a_logged_loss_under_context_parallelism_is_the_sequences_not_a_ranks_chunks(tmp_path):
    """Under cp=2 each rank's loss covers its two chunks of every sequence; what reaches TensorBoard is the loss over
    the whole sequences (combined over the cp group, weighted by items), equal to one process's."""
    single = _fit(tmp_path / "single", 1, ["--trainer.strategy", "single"])
    cp = _fit(tmp_path / "cp", 2, ["--trainer.strategy", "parallel", "--trainer.strategy.cp", "2"])
    assert len(single) == 4 and single.keys() == cp.keys()
    for step, value in single.items():
        assert abs(cp[step] - value) <= 1e-5 * max(1.0, abs(value)), (step, cp[step], value)
