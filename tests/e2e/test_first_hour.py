"""What a new user meets in the first hour (issue 33): a loop the module has no step for is an error naming it; a
script built on ``trainkit.cli.main`` names itself and the subcommand it needs; config.yaml records the schedule a
run used; a plan that fits nothing is one ``error:`` block from rank 0 at any world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, TensorDataset

import trainkit as tk
from tests.e2e.cli_runs import ROOT
from trainkit.cli import main
from trainkit.errors import MissingStep


class Regressor(tk.TrainModule):  # quickstart's, with no test_step nor validation_step
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoForward(Regressor):
    forward = torch.nn.Module.forward

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)


@pytest.mark.parametrize(("loop", "step"), [("test", "test_step"), ("validate", "validation_step")])
def test_a_loop_without_its_step_is_an_error_naming_it(tmp_path, loop, step):
    trainer = tk.Trainer(logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(MissingStep, match=rf"Trainer.{loop} runs Regressor.{step}\(batch, batch_idx\), which it does "
                                          "not define: add one"):
        getattr(trainer, loop)(Regressor(), _loader())


def test_predict_without_predict_step_or_forward_names_them(tmp_path):
    trainer = tk.Trainer(logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    inputs = DataLoader(torch.randn(16, 8), batch_size=4)
    assert len(trainer.predict(Regressor(), inputs)) == 4  # the default predict_step calls forward
    with pytest.raises(MissingStep, match=r"Trainer.predict runs NoForward.predict_step\(batch, batch_idx\), which "
                                          r"it does not define, nor forward\(\)"):
        trainer.predict(NoForward(), inputs)


def test_config_yaml_records_the_schedule_the_run_used(tmp_path):
    main(args=["fit", "--trainer.default_root_dir", str(tmp_path), "--data", "trainkit.demo.markov.MarkovData",
               "--data.train_sequences", "64", "--data.val_sequences", "16", "--trainer.max_steps", "3",
               "--trainer.enable_progress_bar", "false"])
    config = yaml.safe_load((tmp_path / "runs" / "trainkit" / "version_0" / "config.yaml").read_text())
    assert config["model"]["init_args"]["max_steps"] == 3  # the LR schedule spanned the run's 3 steps
    assert "check_val_every_n_epoch" in config["trainer"] and config["trainer"]["check_val_every_n_epoch"] is None


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@pytest.mark.slow
def test_a_script_built_on_main_names_itself_and_the_subcommand_it_needs(tmp_path):
    script = str(ROOT / "examples" / "llama.py")
    proc = _run([script, "--trainer.devices", "2", "--trainer.strategy", "parallel", "--trainer.strategy.tp", "2"],
                tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "llama.py: error: name what to do first: one of fit, validate, test, predict, estimate, export (`llama.py fit "
        "--trainer.devices 2 --trainer.strategy parallel --trainer.strategy.tp 2`, say).",
        "Run `llama.py --help` for the accepted options."]
    proc = _run([script, "fit", "--trainer.devices", "2"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == "llama.py: error: the following arguments are required: --data.path"


@pytest.mark.slow
def test_a_plan_that_fits_nothing_is_one_error_block_from_rank_0(tmp_path):
    proc = _run(["-m", "trainkit.cli", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                 "--trainer.device_memory", "8MB", "--trainer.max_steps", "2", "--trainer.enable_progress_bar",
                 "false"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("trainkit: error: No strategy fits in 8.00 MB per device"), \
        proc.stderr
    assert lines[1] == "Run `trainkit fit --help` for the accepted options."
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stderr


def test_the_demo_datas_options_need_no_class_named(tmp_path):
    """``--data.train_sequences`` on the demo run: the demo data's option (its class is the default), as the docs
    show it; the run reads that many sequences."""
    main(args=["fit", "--trainer.default_root_dir", str(tmp_path), "--data.train_sequences", "48",
               "--data.val_sequences", "16", "--trainer.max_epochs", "1", "--trainer.max_steps", "-1",
               "--trainer.enable_progress_bar", "false"])
    config = yaml.safe_load((tmp_path / "runs" / "trainkit" / "version_0" / "config.yaml").read_text())
    assert config["data"]["class_path"] == "trainkit.demo.markov.MarkovData"
    assert config["data"]["init_args"]["train_sequences"] == 48


def test_resume_says_what_it_restored_and_a_finished_run_that_it_has_nothing_to_do(tmp_path, capsys):
    run = ["fit", "--trainer.default_root_dir", str(tmp_path), "--data.train_sequences", "64",
           "--data.val_sequences", "16", "--trainer.enable_progress_bar", "false"]
    main(args=[*run, "--trainer.max_steps", "3"])
    capsys.readouterr()
    main(args=[*run, "--trainer.max_steps", "5", "--ckpt_path", "last"])
    out = capsys.readouterr().out
    assert f"Restored {tmp_path / 'checkpoints'}" in out and ": step 3, epoch " in out
    assert "Nothing left to do" not in out
    main(args=[*run, "--trainer.max_steps", "5", "--ckpt_path", "last"])
    out = capsys.readouterr().out
    assert ": step 5, epoch " in out
    assert "Nothing left to do: the run already reached max_steps=5; raise --trainer.max_steps" in out


def test_fit_help_lists_the_strategy_names_a_user_passes(capsys):
    with pytest.raises(SystemExit):
        main(args=["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # the help's lines joined
    assert ("a strategy by name: ddp, fsdp, parallel, pipeline, single, zero1, zero2, zero3, zero_offload; its "
            "options follow as --trainer.strategy.<option>") in out


def test_the_progress_bar_ends_on_the_last_epoch_that_ran(tmp_path, capsys):
    """max_epochs=2 runs epochs 0 and 1: the bar's last word on it is epoch=1 (as Lightning's last "Epoch 1")."""
    trainer = tk.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(Regressor(), _loader())
    err = capsys.readouterr().err
    assert "epoch=1" in err.split("\r")[-1] and "epoch=2" not in err


def test_long_work_shows_its_progress_unless_progress_bars_are_off(tmp_path, capsys):
    """Work outside the training loop (sampling a dataset, planning) names itself once it has taken a second, on
    rank 0; with enable_progress_bar=False nothing."""
    import time

    from trainkit import work

    def slow():
        for i in range(12):
            time.sleep(0.25)
            yield i

    work.show_progress(True)
    assert list(work.tracked(slow(), "sampling the test's data", total=12)) == list(range(12))
    assert "sampling the test's data" in capsys.readouterr().err
    assert list(work.tracked(range(3), "quick work")) == [0, 1, 2]
    assert "quick work" not in capsys.readouterr().err  # under a second: nothing
    tk.Trainer(enable_progress_bar=False, logger=False, enable_checkpointing=False, max_steps=1,
               default_root_dir=tmp_path).fit(Regressor(), _loader())
    assert list(work.tracked(slow(), "after a quiet trainer")) == list(range(12))
    assert "after a quiet trainer" not in capsys.readouterr().err
    work.show_progress(True)


def test_an_item_that_takes_long_is_not_a_silence(monkeypatch):
    """While one item takes long (planning one large layout printed nothing for 6 s before), the bar names the item
    in hand; that it redraws itself every tick is tests/unit/test_ticking.py's, on a clock the test moves."""
    import io
    import threading
    import time

    from trainkit import work

    writes: list[str] = []

    class Recorded(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorded())
    monkeypatch.setattr(work, "DELAY_S", 0.1)
    work.show_progress(True)
    for item in work.tracked(["zero2", "fsdp"], "planning 2 strategies", label=str):
        assert any(t.name == "trainkit-progress" for t in threading.enumerate())  # the ticker runs
        shown = len(writes)
        while not any(item in text for text in writes[shown:]):  # the next tick shows it: a hang guard only
            time.sleep(0.05)
    _assert_stops("trainkit-progress")  # and stops with the work


class WatchedValidation(Regressor):
    """Records, at each validation batch of the sanity check, what the bar had printed and whether the thread that
    redraws it while a step or a validation takes long is running."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def validation_step(self, batch, batch_idx):
        import threading

        printed = "step" in sys.stderr.getvalue()
        self.seen.append((printed, any(t.name == "trainkit-progress" for t in threading.enumerate())))
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))


def test_the_training_bar_is_shown_and_kept_alive_from_the_start_of_fit(tmp_path, monkeypatch):
    """The bar appears when fit starts, before the sanity check (it said nothing for the whole sanity check before:
    6 s under torch.compile), and the thread that redraws it every QUIET_S while nothing moves it (its clock logic:
    tests/unit/test_ticking.py) runs from then on and stops with the bar."""
    import io

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    trainer = tk.Trainer(max_steps=1, num_sanity_val_steps=4, logger=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    module = WatchedValidation()
    trainer.fit(module, _loader(), _loader())
    assert module.seen[:4] == [(True, True)] * 4
    _assert_stops("trainkit-progress")


def _assert_stops(name: str) -> None:
    """The threads called ``name`` end (within their next tick: a hang guard only)."""
    import threading

    for thread in [t for t in threading.enumerate() if t.name == name]:
        thread.join(timeout=30)
        assert not thread.is_alive(), f"{name} still running"


@pytest.mark.slow
def test_a_layout_the_model_cannot_divide_into_is_one_error_block_from_rank_0(tmp_path):
    """Found while the strategy cuts the model (after the ranks have started): 3 experts over ep=2."""
    text = tmp_path / "input.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    proc = _run([str(ROOT / "examples" / "moe.py"), "fit", "--data.path", str(text), "--trainer.devices", "2",
                 "--trainer.accelerator", "cpu", "--trainer.strategy", "parallel", "--trainer.strategy.ep", "2",
                 "--model.experts", "3", "--trainer.max_steps", "1"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "moe.py: error: parallel: ep=2 does not divide the 3 experts of a MoE layer: use an ep that divides 3.",
        "Run `moe.py fit --help` for the accepted options."], proc.stderr


class Counted(Regressor):  # counts the batches each loop reads
    def __init__(self) -> None:
        super().__init__()
        self.read = {"validate": 0, "test": 0}

    def validation_step(self, batch, batch_idx):
        self.read["validate"] += 1
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.read["test"] += 1


def test_trainkit_max_steps_caps_each_fit_from_where_it_starts(tmp_path, monkeypatch, capsys):
    """The docs test's rule (docs/trainer.md): TRAINKIT_MAX_STEPS=N stops a fit N steps after it starts or resumes,
    validates there once, saves its checkpoint, and has each evaluation read at most N batches."""
    monkeypatch.setenv("TRAINKIT_MAX_STEPS", "3")
    kwargs = dict(max_epochs=5, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                  num_sanity_val_steps=0)
    module = Counted()
    trainer = tk.Trainer(**kwargs)
    trainer.fit(module, _loader(), _loader())  # 4 batches an epoch, 20 in all without the cap
    assert trainer.global_step == 3 and module.read["validate"] == 3  # one validation, of 3 of its 4 batches
    assert "TRAINKIT_MAX_STEPS=3: this fit stops after 3 step(s), at step 3" in capsys.readouterr().out
    trainer = tk.Trainer(**kwargs)
    trainer.fit(Counted(), _loader(), _loader(), ckpt_path="last")
    assert trainer.global_step == 6
    trainer.test(module, _loader())
    assert module.read["test"] == 3
    monkeypatch.delenv("TRAINKIT_MAX_STEPS")
    trainer = tk.Trainer(**kwargs)
    trainer.fit(Counted(), _loader(), _loader(), ckpt_path="last")
    assert trainer.global_step == 20  # unset: the run's own limits
    monkeypatch.setenv("TRAINKIT_MAX_STEPS", "two")
    with pytest.raises(tk.errors.ConfigurationError, match=r"TRAINKIT_MAX_STEPS='two'.*positive integer"):
        tk.Trainer(**kwargs).fit(Counted(), _loader())


@pytest.mark.slow
@pytest.mark.parametrize(("args", "message"), [
    (["--trainer.strategy", "parallel", "--trainer.strategy.tp", "2", "--model.n_head", "3", "--model.n_embd", "48"],
     "Tensor parallelism gives each of the tp=2 ranks n_head/tp of model.blocks.0.attn's heads, but n_head=3 is not "
     "divisible by 2: use a tp that divides it."),
    (["--trainer.strategy", "pipeline", "--trainer.strategy.split", "[1, 1]"],
     "pipeline split=[1, 1] must give each of the 2 chunks (stages x virtual_stages) at least one layer and add up "
     "to the module's 4 pipeline_layers()."),
], ids=["tp-heads", "pipeline-split"])
def test_a_plan_or_split_the_model_cannot_take_is_one_error_block_from_rank_0(tmp_path, args, message):
    """Found on every rank while the strategy cuts the model: said once, by rank 0, with no traceback per rank."""
    proc = _run(["-m", "trainkit.cli", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                 "--trainer.max_steps", "1", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"trainkit: error: {message}",
                                                "Run `trainkit fit --help` for the accepted options."], proc.stderr


@pytest.mark.slow
def test_a_bug_in_the_user_s_setup_code_keeps_each_rank_s_traceback(tmp_path):
    """Only errors typed as configuration errors are one block: a plain ValueError raised while the strategy sets the
    model up (here the user's configure_model) is a bug to debug, shown with the traceback of every rank."""
    proc = _run(["-m", "trainkit.cli", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                 "--trainer.strategy", "ddp", "--trainer.max_steps", "1", "--model", "tests.e2e.faulty.BrokenModel",
                 "--data", "trainkit.demo.markov.MarkovData"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: Traceback (most recent call last):" in proc.stderr, proc.stderr[-3000:]
        assert f"[rank{rank}]: ValueError: a bug in the user's model" in proc.stderr
    assert "trainkit: error:" not in proc.stderr
