"""The command line as a Lightning user drives it: ``TrainkitCLI`` (LightningCLI) with ``run=False``,
``trainer_defaults`` and ``parser.link_arguments``; ``trainkit predict`` writing its predictions in the dataset's order
at 1 and 2 ranks; ``trainkit validate --ckpt_path best`` in a new process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import DataLoader, DistributedSampler

from tests.e2e.cli_runs import ROOT, fit
from tests.helpers import Recorder, Regression, regression_data
from trainkit.callbacks import Callback
from trainkit.checkpoint import CheckpointReader, latest
from trainkit.cli import TrainkitCLI, main
from trainkit.data import DataModule

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.num_sanity_val_steps", "0"]


class BatchData(DataModule):
    def __init__(self, batch_size: int = 8) -> None:
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(48), batch_size=self.batch_size)


class BatchModel(Regression):
    """Records the batch size it is given (a learning-rate rule might scale by it)."""

    def __init__(self, batch_size: int = 4, lr: float = 1e-2) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


class LinkingCLI(TrainkitCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data.batch_size", "model.batch_size")

    def before_fit(self) -> None:
        self.calls = ["before_fit"]

    def after_fit(self) -> None:
        self.calls.append(f"after_fit at step {self.trainer.global_step}")


def test_run_false_builds_the_trainer_model_and_data_and_runs_nothing(tmp_path):
    cli = LinkingCLI(BatchModel, BatchData, run=False, trainer_defaults={"max_steps": 3, "logger": False,
                                                                       "callbacks": [Recorder()]},
                     args=["--data.batch_size", "16", "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert cli.subcommand is None and cli.trainer.global_step == 0
    assert cli.datamodule.batch_size == 16 and cli.model.hparams.batch_size == 16  # linked
    assert cli.trainer.max_steps == 3  # the default given
    recorder = next(c for c in cli.trainer.callbacks if isinstance(c, Recorder))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 3 and len(recorder.losses) == 3


def test_a_subcommand_runs_with_the_links_the_defaults_and_the_before_and_after_hooks(tmp_path):
    cli = LinkingCLI(BatchModel, BatchData, trainer_defaults={"max_steps": 3},
                     args=["fit", "--data.batch_size", "12", "--trainer.max_steps", "2",  # a flag beats the default
                           "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert cli.subcommand == "fit" and cli.model.hparams.batch_size == 12
    assert cli.calls == ["before_fit", "after_fit at step 2"]
    assert (tmp_path / "runs" / "trainkit" / "version_0" / "config.yaml").is_file()


def test_a_linked_target_is_no_flag_and_save_config_callback_none_writes_no_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        LinkingCLI(BatchModel, BatchData, args=["fit", "--model.batch_size", "3"])
    assert exit_info.value.code == 2
    assert 'trainkit: error: Linked "model.batch_size" must be given via "data.batch_size".' in capsys.readouterr().err
    TrainkitCLI(BatchModel, BatchData, save_config_callback=None,
                args=["fit", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert (tmp_path / "runs" / "trainkit" / "version_0").is_dir()
    assert not (tmp_path / "runs" / "trainkit" / "version_0" / "config.yaml").exists()


class Drawn(BatchModel):
    """Draws from the global random state as it is built (before its network, which seeds itself): what it drew
    says which seed was set before."""

    def __init__(self, batch_size: int = 4, lr: float = 1e-2) -> None:
        drawn = torch.randn(3)
        super().__init__(batch_size=batch_size, lr=lr)
        self.drawn = drawn


def _drawn_after(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(3)


def test_seed_everything_seeds_before_the_model_is_built_and_the_config_records_the_seed(tmp_path, monkeypatch):
    """Lightning's ``seed_everything_default`` and ``--seed_everything``: an int; True (the default) for the seed a
    launching rank 0 exported, else 0; false for none."""
    monkeypatch.delenv("TRAINKIT_SEED", raising=False)
    args = ["--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", *QUIET]
    cli = TrainkitCLI(Drawn, BatchData, run=False, seed_everything_default=1234, args=args)
    assert torch.equal(cli.model.drawn, _drawn_after(1234)) and cli.config.seed_everything == 1234
    cli = TrainkitCLI(Drawn, BatchData, run=False, seed_everything_default=1234, args=[*args, "--seed_everything", "7"])
    assert torch.equal(cli.model.drawn, _drawn_after(7))
    monkeypatch.delenv("TRAINKIT_SEED")
    cli = TrainkitCLI(Drawn, BatchData, run=False, args=args)  # True: no seed exported, so 0, as Lightning's
    assert torch.equal(cli.model.drawn, _drawn_after(0)) and cli.config.seed_everything == 0
    monkeypatch.setenv("TRAINKIT_SEED", "5")  # what a rank trainkit launched inherits from rank 0
    cli = TrainkitCLI(Drawn, BatchData, run=False, args=args)
    assert torch.equal(cli.model.drawn, _drawn_after(5)) and cli.config.seed_everything == 5
    want = _drawn_after(99)
    torch.manual_seed(99)
    cli = TrainkitCLI(Drawn, BatchData, run=False, args=[*args, "--seed_everything", "false"])
    assert torch.equal(cli.model.drawn, want) and cli.config.seed_everything is False
    TrainkitCLI(Drawn, BatchData, seed_everything_default=3,
                args=["fit", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), *QUIET])
    saved = (tmp_path / "runs" / "trainkit" / "version_0" / "config.yaml").read_text()
    assert "\nseed_everything: 3\n" in saved


FIXED_LOG = ["--trainer.logger", "trainkit.loggers.TensorBoardLogger", "--trainer.logger.version", "run"]


def test_save_config_kwargs_overwrite_and_the_file_name(tmp_path, capsys):
    """A configuration already in the log directory is Lightning's error, which names save_config_kwargs; with
    ``{"overwrite": True}`` the file is replaced. ``run=False`` writes it when the first run sets up, once."""
    root = ["--trainer.default_root_dir", str(tmp_path), "--trainer.logger.root_dir", str(tmp_path / "runs"), *QUIET]
    TrainkitCLI(BatchModel, BatchData, args=["fit", "--trainer.max_steps", "1", *FIXED_LOG, *root])
    config = tmp_path / "runs" / "trainkit" / "run" / "config.yaml"
    assert "max_steps: 1\n" in config.read_text()
    with pytest.raises(SystemExit) as exit_info:
        TrainkitCLI(BatchModel, BatchData, args=["fit", "--trainer.max_steps", "2", *FIXED_LOG, *root])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"trainkit: error: {config} exists (a previous run's configuration), and SaveConfigCallback does not "
            'overwrite it: delete it, pass save_config_kwargs={"overwrite": True} to TrainkitCLI to overwrite it, or '
            "save_config_callback=None to write none.") in err
    cli = TrainkitCLI(BatchModel, BatchData, run=False, save_config_kwargs={"overwrite": True},
                      args=["--trainer.max_steps", "3", *FIXED_LOG, *root])
    assert "max_steps: 1\n" in config.read_text()  # nothing ran yet
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "max_steps: 3\n" in config.read_text()
    config.unlink()
    cli.trainer.validate(cli.model, DataLoader(regression_data(8), batch_size=4))  # written at the first run only
    assert not config.exists()
    TrainkitCLI(BatchModel, BatchData, save_config_kwargs={"config_filename": "run.yaml"},
                args=["fit", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert (tmp_path / "runs" / "trainkit" / "version_0" / "run.yaml").is_file()


class Every(Callback):
    """A callback with options of its own, counting the optimizer steps it sees."""

    def __init__(self, every: int = 1, label: str = "none") -> None:
        self.every, self.label, self.seen = every, label, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen += 1


class GroupCLI(TrainkitCLI):
    """Lightning's finetuning example's shape: a callback's options as a group, linked into the model, and
    defaults set by the parser."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(Every, "every")
        parser.add_lightning_class_args(BatchData, "extra")  # not a callback: an instance in config_init
        parser.link_arguments("every.every", "model.batch_size")
        parser.set_defaults({"trainer.max_steps": 2, "every.label": "set_defaults"})


def test_add_lightning_class_args_a_callback_joins_the_trainer_and_links_and_set_defaults_apply(tmp_path):
    args = ["--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", *QUIET]
    for run in (False, True):  # one parser, and each subcommand's
        cli = GroupCLI(BatchModel, BatchData, run=run, trainer_defaults={"callbacks": [Recorder()]},
                       args=[*(["fit"] if run else []), "--every.every", "6", "--extra.batch_size", "5", *args])
        every = [c for c in cli.trainer.callbacks if isinstance(c, Every)]
        assert len(every) == 1 and every[0].every == 6 and every[0].label == "set_defaults"
        kinds = [type(c).__name__ for c in cli.trainer.callbacks[:3]]
        assert kinds == ["Every", "Recorder", "SaveConfigCallback"]  # Lightning's order
        assert cli.model.hparams.batch_size == 6 and cli.trainer.max_steps == 2
        config_init = cli.config_init["fit"] if run else cli.config_init
        assert isinstance(config_init.extra, BatchData) and config_init.extra.batch_size == 5
        if not run:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert every[0].seen == 2


def test_add_lightning_class_args_of_another_class_names_add_class_arguments():
    class Other(TrainkitCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_lightning_class_args(torch.nn.Linear, "linear")

    with pytest.raises(TypeError, match=r"add_lightning_class_args takes a Trainer, TrainModule, DataModule or "
                                        r"Callback class \(or a function returning one\); got <class 'torch.nn.modules"
                                        r".linear.Linear'>\. Add other classes with parser.add_class_arguments\(cls, "
                                        r"'linear'\)\."):
        Other(BatchModel, BatchData, run=False, args=[])


SAMPLES = 29  # not a multiple of 2 ranks x 4: uneven shares, and a DistributedSampler pads one sample


class Predicting(Regression):
    """Predicts over two loaders of the same 29 samples: trainkit's sampler, and torch's DistributedSampler (which
    pads rank 1's share with sample 0)."""

    def predict_dataloader(self) -> list[DataLoader]:
        data = regression_data(SAMPLES)
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return [DataLoader(data, batch_size=4), DataLoader(data, batch_size=4, sampler=sampler)]

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"y": self(batch[0]), "x": batch[0]}


class SummingOnRankOne(Predicting):
    """Rank 1 sums each batch's outputs to a scalar, which a file of rows cannot hold."""

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().predict_step(batch, batch_idx)
        return {k: v.sum() for k, v in out.items()} if self.global_rank == 1 else out


def _expected() -> dict[str, torch.Tensor]:
    x = regression_data(SAMPLES).tensors[0]
    with torch.no_grad():
        return {"y": Regression()(x), "x": x}


def _check(path: Path) -> dict[str, torch.Tensor]:
    got = load_file(path)
    want = _expected()
    assert sorted(got) == ["dataloader0/x", "dataloader0/y", "dataloader1/x", "dataloader1/y"]
    for loader in ("dataloader0", "dataloader1"):
        assert torch.equal(got[f"{loader}/x"], want["x"])  # every sample once, in the dataset's order
        torch.testing.assert_close(got[f"{loader}/y"], want["y"], rtol=1e-6, atol=1e-7)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "trainkit-predictions"}
    return got


def test_predict_writes_the_predictions_in_the_dataset_s_order(tmp_path, capsys):
    main(args=["predict", "--model", "tests.e2e.test_lightning_cli.Predicting", "--trainer.logger", "false",
               "--trainer.default_root_dir", str(tmp_path), *QUIET])
    _check(tmp_path / "predictions.safetensors")
    assert (f"Wrote the predictions of 29 samples to {tmp_path / 'predictions.safetensors'} (dataloader0/y [29, 1], "
            "dataloader0/x [29, 8], dataloader1/y [29, 1], dataloader1/x [29, 8]).") in capsys.readouterr().out


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_predict_at_2_ranks_writes_the_same_file_as_at_1(tmp_path):
    out = tmp_path / "out" / "preds.safetensors"
    _cli(tmp_path, "predict", "--model", "tests.e2e.test_lightning_cli.Predicting", "--trainer.devices", "2",
         "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.logger", "false",
         "--trainer.timeout_s", "120", "--output", str(out), *QUIET)
    _check(out)


@pytest.mark.slow
def test_predictions_one_rank_cannot_write_are_one_error_on_every_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "predict", "--model",
                           "tests.e2e.test_lightning_cli.SummingOnRankOne", "--trainer.devices", "2",
                           "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.logger", "false",
                           "--trainer.timeout_s", "120", *QUIET], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-4000:]  # a configuration error, not a peer's failure or a timeout
    assert "the batch as its first dimension" in proc.stderr and "PeerError" not in proc.stderr


@pytest.mark.slow
def test_validate_ckpt_path_best_in_a_new_process_loads_the_best_the_fit_ranked(tmp_path):
    """mode="max" over a falling val_loss: the best is the first checkpoint, not the newest."""
    fit(tmp_path, "single", devices=1, max_steps=20, batch=16,
        extra=("--trainer.callbacks.monitor", "val_loss", "--trainer.callbacks.mode", "max"))
    saved = CheckpointReader(latest(tmp_path / "checkpoints")).meta["callbacks"]
    record = next(r for r in saved.values() if r.get("monitor") == "val_loss")
    best = max(record["saved"], key=lambda s: s["score"])
    assert best["step"] == 10 and record["mode"] == "max"
    proc = _cli(tmp_path, "validate", "--ckpt_path", "best", "--trainer.default_root_dir", str(tmp_path),
                "--trainer.logger", "false", "--data", "trainkit.demo.markov.MarkovData", "--data.val_sequences",
                "16", "--model.bias", "false", *QUIET)
    assert f"Restored {tmp_path / 'checkpoints' / best['name']}." in proc.stdout


def test_ckpt_path_best_with_nothing_monitored_is_one_error_block(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["validate", "--ckpt_path", "best", "--trainer.default_root_dir", str(tmp_path), "--trainer.logger",
                   "false", "--data.train_sequences", "64", "--data.val_sequences", "16", *QUIET])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith('trainkit: error: ckpt_path="best" needs checkpoints written by a ModelCheckpoint')
    assert err[-1] == "Run `trainkit validate --help` for the accepted options."
