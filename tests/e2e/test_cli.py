"""The command line: the demo run, TensorBoard output, config round-trips and clear errors."""

from __future__ import annotations

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainkit.cli import main, normalize_argv

SMALL_DEMO = [
    "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "320", "--data.val_sequences", "64",
    "--trainer.max_steps", "20", "--trainer.val_check_interval", "10", "--trainer.log_every_n_steps", "5",
    "--trainer.enable_progress_bar", "false",
]


def test_demo_fit_writes_tensorboard_scalars(tmp_path, capsys):
    main(args=["fit", "--trainer.default_root_dir", str(tmp_path), *SMALL_DEMO])
    out = capsys.readouterr().out
    assert "Markov entropy floor H =" in out
    run = tmp_path / "runs" / "trainkit" / "version_0"
    events = EventAccumulator(str(run))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train_loss", "val_loss", "val_excess"} <= set(scalars)
    assert [e.step for e in events.Scalars("train_loss")] == [5, 10, 15, 20]
    assert [e.step for e in events.Scalars("val_loss")] == [10, 20]
    losses = [e.value for e in events.Scalars("train_loss")]
    assert all(2.0 < v < 3.0 for v in losses)  # near ln(16) = 2.77 at the start of training
    assert (run / "config.yaml").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "epoch=1-step=20"


def test_print_config_round_trips_through_config(tmp_path, capsys):
    args = ["fit", "--trainer.max_steps", "7", "--trainer.precision", "bf16-mixed", "--model.lr", "0.01",
            "--trainer.strategy", "single", "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        main(args=args)
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    assert config["trainer"]["max_steps"] == 7
    assert config["trainer"]["precision"] == "bf16-mixed"
    assert config["trainer"]["strategy"]["class_path"] == "trainkit_strategies.data_parallel.single.SingleStrategy"
    path = tmp_path / "config.yaml"
    path.write_text(printed)
    with pytest.raises(SystemExit):
        main(args=["fit", "--config", str(path), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out) == config


def test_subcommand_position_does_not_matter():
    assert normalize_argv(["--trainer.max_steps", "3", "fit"])[0] == "fit"
    assert normalize_argv(["--config", "x.yaml", "validate"])[:3] == ["validate", "--config", "x.yaml"]


def test_unknown_strategy_lists_valid_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--trainer.strategy", "zero9", "--trainer.default_root_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Unknown strategy 'zero9'" in err and "single" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.max_steps", "many"], "max_steps"),
        (["--trainer.precision", "fp8"], "Unknown precision 'fp8'"),
        (["--trainer.accumulate_grad_batches", "0"], "accumulate_grad_batches must be >= 1"),
        (["--trainer.bogus", "1"], "bogus"),
        (["--trainer.val_check_interval", "0"], "trainkit: error: val_check_interval=0: use an int >= 1"),  # not 1/0
        (["--data.batch_size", "0"], "trainkit: error: batch_size must be >= 1 (the samples in one rank's batch); "
                                     "got 0."),
    ],
)
def test_bad_values_fail_with_a_clear_message(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--trainer.default_root_dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_predict_without_predict_data_is_one_error_block(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["predict", "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
                   "--data.train_sequences", "64", "--data.val_sequences", "16"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "trainkit: error: No predict data: the DataModule MarkovData has no predict_dataloader(). Define "
        "predict_dataloader() in the module or its DataModule (--data CLASS on the command line), or pass dataloaders "
        "to Trainer.predict().", "Run `trainkit predict --help` for the accepted options."]


@pytest.mark.slow
def test_a_bad_argument_prints_the_error_and_its_fix_once_without_the_usage(tmp_path):
    """One short block: the error naming the fix and where the options are; not the 40-line usage first, and once
    also when trainkit has launched the ranks (``--trainer.devices 2``: every rank fails the same way on the same
    command line, and only rank 0 says so)."""
    import os
    import subprocess
    import sys

    from tests.e2e.cli_runs import ROOT

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for args, message in [
        (["--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.strategy", "zero2",
          "--trainer.strategy.bucket_mb", "-1"], "trainkit: error: zero2 bucket_mb must be positive; got -1.0."),
        (["--trainer.max_stepz", "3"], "trainkit: error: unrecognized arguments: --trainer.max_stepz 3"),
        (["--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.strategy", "pipeline",  # after launch
          "--trainer.strategy.stages", "3"],
         "trainkit: error: pipeline: world_size=2 is not a multiple of stages=3; use a world size of stages x "
         "replicas."),
    ]:
        proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "fit", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=env)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert lines == [message, "Run `trainkit fit --help` for the accepted options."], proc.stderr


@pytest.mark.slow
def test_the_command_exits_quickly_but_lets_the_run_s_last_work_finish(tmp_path):
    """`trainkit` leaves without the interpreter's module teardown (half a second a rank), yet a thread still writing
    and the exit handlers (a user's, the process group's) finish first, on every rank; checkpoints and events are
    complete."""
    import os
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.e2e.cli_runs import ROOT
    from trainkit.checkpoint import CheckpointReader, latest

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
         "--trainer.strategy", "ddp", *SMALL_DEMO, "--trainer.callbacks+=tests.e2e.probes.LateWriters"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"late.thread.{rank}").read_text() == "step 20"
        assert (tmp_path / f"late.atexit.{rank}").read_text() == "step 20"
    assert CheckpointReader(latest(tmp_path / "checkpoints")).meta["loop"]["global_step"] == 20
    events = EventAccumulator(str(next((tmp_path / "runs").rglob("events.out.*")).parent))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")][-1] == 20
