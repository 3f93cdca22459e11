"""A user's own script: ``trainkit.cli.main(MyModule)``, examples/gpt.py on a text file, and examples/lightning/."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

import trainkit as tk
from tests.helpers import DEVICE, accelerator_for
from trainkit.checkpoint import CheckpointReader, latest
from trainkit.cli import main

from .cli_runs import ROOT
from .lightning_examples import EXAMPLES, command, logged, printed_tensor, run


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


class Regressor(tk.TrainModule):
    def __init__(self, lr: float = 1e-3, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=16)


def test_main_with_a_fixed_module_trains_like_a_plain_loop(tmp_path):
    main(Regressor, args=["fit", "--model.lr", "0.02", "--model.hidden", "12", "--trainer.max_epochs", "2",
                          "--trainer.seed", "3", "--trainer.enable_progress_bar", "false",
                          "--trainer.default_root_dir", str(tmp_path)])
    torch.manual_seed(3)
    ref = Regressor(lr=0.02, hidden=12).to(DEVICE)  # where the trainer ran (accelerator "auto")
    opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    for _ in range(2):
        for x, y in DataLoader(_data(), batch_size=16):
            F.mse_loss(ref.net(x.to(DEVICE)), y.to(DEVICE)).backward()
            opt.step()
            opt.zero_grad()
    reader = CheckpointReader(latest(tmp_path / "checkpoints"))
    assert reader.meta["loop"]["global_step"] == 12 and reader.meta["hyperparameters"]["hidden"] == 12
    for name, param in ref.named_parameters():
        torch.testing.assert_close(reader.full(f"model/{name}"), param.detach().cpu(), rtol=0, atol=0)


class NoArguments(Regressor):
    def __init__(self) -> None:
        super().__init__(lr=0.01)


def test_main_with_a_module_without_init_arguments(tmp_path):
    main(NoArguments, args=["fit", "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
                            "--trainer.default_root_dir", str(tmp_path)])
    assert CheckpointReader(latest(tmp_path / "checkpoints")).meta["loop"]["global_step"] == 6


def test_own_shuffled_loader_trains_like_a_plain_loop(tmp_path):
    """use_distributed_sampler=False keeps a seeded shuffling loader as it is: over several epochs the
    trainer draws the same orders from its generator as a ``for`` loop, so the parameters match exactly."""
    tk.seed_everything(4)
    module = Regressor(lr=0.02)
    trainer = tk.Trainer(max_epochs=3, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(_data(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(9)))
    torch.manual_seed(4)
    ref = Regressor(lr=0.02).to(DEVICE)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    loader = DataLoader(_data(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(9))
    for _ in range(3):
        for x, y in loader:
            F.mse_loss(ref.net(x.to(DEVICE)), y.to(DEVICE)).backward()
            opt.step()
            opt.zero_grad()
    for got, want in zip(module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_examples_gpt_trains_on_a_text_file_sharded_and_samples(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = str(ROOT / "examples" / "gpt.py")
    small = ["--model.n_layer", "1", "--model.n_embd", "32", "--model.block_size", "32", "--data.block_size", "32",
             "--data.batch_size", "8"]
    fit = subprocess.run(
        [sys.executable, script, "fit", "--data.path", str(text), "--trainer.accelerator", accelerator_for(2),
         "--trainer.devices", "2", "--trainer.strategy",
         "fsdp", "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.timeout_s", "120",
         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path), *small],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-4000:]
    assert "validation loss" in fit.stdout
    reader = CheckpointReader(latest(tmp_path / "checkpoints"))
    assert reader.meta["strategy"] == "fsdp" and reader.meta["world_size"] == 2
    assert reader.info("model/model.wte.weight")[0] == (256, 32)
    out = subprocess.run([sys.executable, script, "sample", "--checkpoint", str(tmp_path / "checkpoints"),
                          "--prompt", "the ", "--length", "40"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("the ") and len(out.stdout) >= 30


@pytest.mark.slow
def test_lightning_autoencoder_fits_tests_and_predicts_from_its_best_checkpoint(tmp_path):
    """examples/lightning/autoencoder.py as Lightning's: its rank-zero callback reports every epoch, the test loss of
    the best checkpoint is logged per batch and per epoch, and the predictions come back from ``predict``."""
    out = run(command("autoencoder", EXAMPLES / "autoencoder.py", 1), tmp_path)
    assert "epoch 0: 3 validation images reconstructed" in out and "epoch 1: 3 validation" in out, out[-2000:]
    values = logged(tmp_path)
    assert len(values["train_loss"]) == 26 and len(values["val_loss_step"]) == 6 and len(values["test_loss_step"]) == 3
    assert values["test_loss_epoch"][-1] < values["train_loss"][0] / 4
    assert printed_tensor(out).count("[") > 2


@pytest.mark.slow
def test_lightning_gan_steps_both_networks_and_logs_samples(tmp_path):
    """examples/lightning/gan.py: two optimizers under manual optimization log both losses at every batch, and the
    epoch-end hook draws on ``self.loggers`` for one image of samples an epoch."""
    run(command("gan", EXAMPLES / "gan.py", 1), tmp_path)
    values = logged(tmp_path)
    assert len(values["g_loss"]) == len(values["d_loss"]) == 16  # 2 epochs of 8 batches
    assert values["d_loss"][-1] < values["d_loss"][0]
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.step for e in events.Images("generated_images")] == [0, 1]


@pytest.mark.slow
def test_lightning_finetuning_learns_once_the_backbone_is_unfrozen(tmp_path):
    """examples/lightning/finetuning.py: frozen, the backbone's BatchNorm statistics are never gathered and the
    classifier guesses (validation accuracy 0.5, as under Lightning); unfrozen at epoch 2 and added to the optimizer
    as a parameter group, the network separates the classes within the epoch."""
    run([*command("finetuning", EXAMPLES / "finetuning.py", 1), "--finetuning.milestones", "[2,4]",
         "--trainer.limit_train_batches", "48"], tmp_path)
    accuracy = logged(tmp_path)["val_acc"]
    assert len(accuracy) == 3 and accuracy[1] < 0.6 and accuracy[2] > 0.9, accuracy


USER_SCRIPT = '''
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import trainkit as tk
from trainkit.cli import main


class Deep(tk.TrainModule):
    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                          torch.nn.GELU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.layers(x), y), sync_dist=True)

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def _data(self, seed, n):
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
        return TensorDataset(x, x.pow(2).sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self._data(0, 64), batch_size=16, shuffle=True)

    def test_dataloader(self):
        return DataLoader(self._data(1, 37), batch_size=16)  # a short last batch of 5


if __name__ == "__main__":
    main(Deep)
'''


@pytest.mark.slow
def test_test_subcommand_prints_the_same_results_under_pipeline(tmp_path):
    """`test` prints its results table with the progress bar off; a pipeline without
    pipeline_validation_step reports pipeline_loss as test_loss, equal to test_step's one-process value."""
    script = tmp_path / "deep.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = ["--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
              "--trainer.timeout_s", "120", "--trainer.accelerator", accelerator_for(2)]  # compared: one device type

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, str(script), *args, *common], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    run("fit", "--trainer.max_epochs", "2", "--trainer.seed", "0")
    single = run("test", "--ckpt_path", "last")
    piped = run("test", "--ckpt_path", "last", "--trainer.strategy", "pipeline", "--trainer.devices", "2",
                "--trainer.strategy.microbatches", "2")

    def value(out: str) -> float:
        assert "test results" in out, out
        return float(out.split("test_loss")[-1].split()[0])

    assert abs(value(piped) - value(single)) <= 2e-5 * abs(value(single))  # printed to 6 digits
