"""The Trainer arguments and loop behaviours a Lightning user reaches for, each as Lightning 2.x behaves:
overfit_batches, max_time, min_epochs/min_steps, sync_batchnorm, benchmark, inference_mode,
reload_dataloaders_every_n_epochs, devices "auto"/-1, accelerator "gpu", rank_zero_only, a positional DataModule,
steps without batch_idx, and per-batch validation/test logging."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import trainkit as tk
from tests.helpers import Regression, loader, quiet_trainer, regression_data
from tests.parity.harness import free_port
from trainkit.arguments import parse_max_time, resolve_devices
from trainkit.callbacks import Callback, EarlyStopping, ModelCheckpoint
from trainkit.checkpoint import CheckpointReader
from trainkit.errors import ConfigurationError
from trainkit.loggers import Logger
from trainkit_strategies.data_parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm


class Seen(Regression):
    """Records the inputs of every training and validation batch."""

    def __init__(self) -> None:
        super().__init__()
        self.train_seen: list[torch.Tensor] = []
        self.val_seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_seen.append(batch[0].clone())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_seen.append(batch[0].clone())
        super().validation_step(batch, batch_idx)


def test_overfit_batches_trains_and_validates_on_the_same_first_batches_in_order(tmp_path):
    """Lightning 2.x: limit_train_batches and limit_val_batches become overfit_batches, and both loaders read in order
    (a shuffling training loader is turned sequential), so every epoch sees the same batches; validation reads its own
    loader's first batches ("training and validation use different sets of data")."""
    train, val = regression_data(16, seed=1), regression_data(12, seed=2)
    module = Seen()
    trainer = quiet_trainer(tmp_path, overfit_batches=2, max_epochs=3)
    with pytest.warns(UserWarning, match="overfit_batches turns the shuffling"):
        trainer.fit(module, loader(train, 4, shuffle=True), loader(val, 4))
    first = [train.tensors[0][0:4], train.tensors[0][4:8]]
    assert len(module.train_seen) == 6
    for got, want in zip(module.train_seen, first * 3, strict=True):
        torch.testing.assert_close(got, want)
    assert len(module.val_seen) == 6  # 2 batches at each epoch's end
    for got, want in zip(module.val_seen, [val.tensors[0][0:4], val.tensors[0][4:8]] * 3, strict=True):
        torch.testing.assert_close(got, want)
    fraction = Seen()
    quiet_trainer(tmp_path, overfit_batches=0.25, max_epochs=1).fit(fraction, loader(train, 4, shuffle=True),
                                                                    loader(val, 4))
    assert len(fraction.train_seen) == 1 and torch.equal(fraction.train_seen[0], first[0])
    with pytest.raises(ConfigurationError, match="overfit_batches=-1"):
        quiet_trainer(tmp_path, overfit_batches=-1)


class Clock:
    """A monotonic clock that one step moves by one second."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Tick(Callback):
    def __init__(self, clock: Clock, seconds: float = 1.0) -> None:
        self.clock, self.seconds = clock, seconds

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.clock.now += self.seconds


def test_max_time_stops_at_a_step_boundary_with_a_checkpoint_and_its_time_survives_resume(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr("trainkit.callbacks.timer.time", clock)
    data = loader(regression_data(64), 4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = quiet_trainer(tmp_path, max_time={"seconds": 5}, max_epochs=None, callbacks=[Tick(clock), ckpt],
                            enable_checkpointing=True)
    assert trainer.max_epochs is None  # max_time alone limits the run, as in Lightning
    trainer.fit(Regression(), data)
    assert trainer.global_step == 5 and trainer.progress.stop_reason == "max_time"
    path = trainer.resolve_ckpt_path("last")
    meta = CheckpointReader(path).meta
    assert meta["loop"]["global_step"] == 5 and meta["loop"]["stop_reason"] == "max_time"
    assert meta["callbacks"]["Timer"]["time_elapsed"]["train"] == pytest.approx(5.0)
    # resumed with 3 more seconds allowed: the 5 spent count, so it stops 3 steps later
    resumed = quiet_trainer(tmp_path, max_time="00:00:00:08", callbacks=[Tick(clock), ModelCheckpoint(
        dirpath=tmp_path / "resumed")], enable_checkpointing=True)
    resumed.fit(Regression(), data, ckpt_path=path)
    assert resumed.global_step == 8 and resumed.progress.stop_reason == "max_time"
    spent = quiet_trainer(tmp_path, max_time=timedelta(seconds=5))  # resumed with its time already spent: no step
    spent.fit(Regression(), data, ckpt_path=path)
    assert spent.global_step == 5


def test_max_time_forms_and_errors():
    assert parse_max_time("01:02:03:04") == 93784.0
    assert parse_max_time({"hours": 1, "minutes": 30}) == 5400.0
    assert parse_max_time(timedelta(minutes=2)) == 120.0
    with pytest.raises(ConfigurationError, match="DD:HH:MM:SS"):
        parse_max_time("1:30")
    with pytest.raises(ConfigurationError, match="timedelta's"):
        parse_max_time({"hour": 1})


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_min_steps_and_min_epochs_defer_early_stopping(tmp_path):
    data, val = loader(regression_data(32), 4), loader(regression_data(8, seed=3), 4)
    stop = lambda: EarlyStopping(monitor="val_loss", stopping_threshold=1e9)  # stops at the first validation
    alone = quiet_trainer(tmp_path, max_epochs=3, val_check_interval=1, callbacks=[stop()])
    alone.fit(Regression(), data, val)
    assert alone.global_step == 1
    deferred = quiet_trainer(tmp_path, max_epochs=3, val_check_interval=1, callbacks=[stop()], min_steps=5)
    deferred.fit(Regression(), data, val)
    assert deferred.global_step == 5 and deferred.progress.stop_reason == "should_stop"
    epochs = quiet_trainer(tmp_path, max_epochs=5, callbacks=[StopAt(1)], min_epochs=2)
    epochs.fit(Regression(), data)
    assert epochs.global_step == 16 and epochs.current_epoch == 2  # two whole epochs of 8 batches


def test_benchmark_sets_cudnn_benchmark():
    before = torch.backends.cudnn.benchmark
    try:
        quiet_trainer(".", benchmark=True)
        assert torch.backends.cudnn.benchmark is True
        quiet_trainer(".", benchmark=False)
        assert torch.backends.cudnn.benchmark is False
        torch.backends.cudnn.benchmark = True
        quiet_trainer(".", deterministic=True)  # None under deterministic: off, as in Lightning
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before


class GradMode(Regression):
    """Records, per loop, whether it ran under inference mode and with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[tuple[str, bool, bool]] = []

    def _record(self, loop: str) -> None:
        self.modes.append((loop, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record("fit-validate" if self.trainer.state == "fit" else "validate")
        super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._record("test")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        self._record("predict")
        return self(batch[0])


def test_inference_mode_for_validate_test_predict_and_no_grad_during_fit(tmp_path):
    data = loader(regression_data(8), 4)
    module = GradMode()
    trainer = quiet_trainer(tmp_path)
    trainer.fit(module, data, data)
    trainer.validate(module, data, verbose=False)
    trainer.test(module, data, verbose=False)
    trainer.predict(module, data)
    assert set(module.modes) == {("fit-validate", False, False), ("validate", True, False), ("test", True, False),
                                 ("predict", True, False)}
    module.modes.clear()
    off = quiet_trainer(tmp_path, inference_mode=False)
    off.validate(module, data, verbose=False)
    off.predict(module, data)
    assert set(module.modes) == {("validate", False, False), ("predict", False, False)}


class EpochData(Regression):
    """Its dataloaders are built from ``current_epoch`` (a curriculum): which epochs asked for them is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.train_built: list[int] = []
        self.val_built: list[int] = []

    def train_dataloader(self) -> DataLoader:
        self.train_built.append(self.current_epoch)
        return loader(regression_data(16, seed=10 + self.current_epoch), 4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.val_built.append(self.current_epoch)
        return loader(regression_data(8, seed=20 + self.current_epoch), 4)


def test_reload_dataloaders_every_n_epochs_and_a_resume_mid_epoch(tmp_path):
    module = EpochData()
    quiet_trainer(tmp_path, max_epochs=5, reload_dataloaders_every_n_epochs=2).fit(module)
    assert module.train_built == [0, 2, 4] and module.val_built == [0, 2, 4]

    whole = EpochData()
    quiet_trainer(tmp_path, max_epochs=3, reload_dataloaders_every_n_epochs=2, seed=0).fit(whole)
    first = EpochData()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "mid")
    stopped = quiet_trainer(tmp_path, max_epochs=3, max_steps=10, reload_dataloaders_every_n_epochs=2, seed=0,
                            callbacks=[ckpt], enable_checkpointing=True)
    stopped.fit(first)  # stops 2 batches into epoch 2, after its reload
    path = stopped.resolve_ckpt_path("last")
    assert CheckpointReader(path).meta["loop"]["batch_idx"] == 2
    second = EpochData()
    quiet_trainer(tmp_path, max_epochs=3, reload_dataloaders_every_n_epochs=2, seed=0).fit(second, ckpt_path=path)
    assert second.train_built == [0, 2]  # at the start of the run, then again for the epoch it resumes in
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], value, rtol=0, atol=0)


def test_devices_auto_and_minus_one_and_accelerator_gpu(tmp_path, monkeypatch):
    for devices in ("auto", -1, "1"):
        trainer = quiet_trainer(tmp_path, accelerator="cpu", devices=devices)
        assert trainer.devices == 1 and trainer.world_size == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_devices("auto", "auto") == resolve_devices(-1, "cuda") == resolve_devices("0,1,2,3", "cuda") == 4
    assert resolve_devices([0, 1], "cuda") == 2 and resolve_devices("auto", "cpu") == 1
    with pytest.raises(ConfigurationError, match="CUDA_VISIBLE_DEVICES=0,2 and pass devices=2"):
        resolve_devices([0, 2], "cuda")
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match=r"accelerator='gpu' asks for a CUDA GPU.*accelerator='cpu'"):
            quiet_trainer(tmp_path, accelerator="gpu")


def test_the_command_line_takes_devices_auto_and_minus_one(tmp_path):
    from trainkit.cli import build_parser, normalize_argv

    parser = build_parser()
    for value in ("auto", "-1"):
        cfg = parser.parse_args(normalize_argv(["fit", "--trainer.devices", value, "--trainer.accelerator", "cpu",
                                                "--trainer.max_time", "00:00:10:00", "--trainer.overfit_batches", "2",
                                                "--trainer.logger", "false"]))
        trainer = tk.Trainer(**dict(parser.instantiate(cfg).fit.trainer))
        assert trainer.devices == 1 and trainer.max_time == 600.0 and trainer.limit_train_batches == 2


def test_rank_zero_only_is_exported_with_its_rank_set():
    from lightning_utilities.core.rank_zero import rank_zero_only as upstream

    from trainkit.utilities import rank_zero_only

    assert tk.rank_zero_only is rank_zero_only is upstream
    assert rank_zero_only.rank is not None
    said = rank_zero_only(lambda: "said")
    before = rank_zero_only.rank
    try:
        rank_zero_only.rank = 0
        assert said() == "said"
        rank_zero_only.rank = 1
        assert said() is None
    finally:
        rank_zero_only.rank = before


class RegressionData(tk.DataModule):
    def train_dataloader(self) -> DataLoader:
        return loader(regression_data(16), 4)

    def val_dataloader(self) -> DataLoader:
        return loader(regression_data(8, seed=3), 4)

    def test_dataloader(self) -> DataLoader:
        return loader(regression_data(8, seed=4), 4)

    def predict_dataloader(self) -> DataLoader:
        return loader(regression_data(8, seed=5), 4)


class NoBatchIdx(Regression):
    """Lightning's steps without ``batch_idx``."""

    def training_step(self, batch):
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch):
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch):
        return self(batch[0])


def test_a_datamodule_passed_where_the_dataloaders_go(tmp_path):
    module, dm = GradMode(), RegressionData()
    trainer = quiet_trainer(tmp_path)
    trainer.fit(module, dm)
    assert trainer.global_step == 4 and "val_loss" in trainer.callback_metrics
    assert "val_loss" in trainer.validate(module, dm, verbose=False)[0]
    trainer.test(module, dm, verbose=False)
    assert len(trainer.predict(module, dm)) == 2
    assert [loop for loop, *_ in module.modes].count("test") == 2
    with pytest.raises(ConfigurationError, match="dataloaders and a datamodule"):
        trainer.fit(module, dm, loader(regression_data(8), 4))


def test_steps_without_batch_idx(tmp_path):
    module, data = NoBatchIdx(), loader(regression_data(16), 4)
    trainer = quiet_trainer(tmp_path)
    trainer.fit(module, data, data)
    assert trainer.global_step == 4 and "val_loss" in trainer.callback_metrics
    assert "val_loss" in trainer.validate(module, data, verbose=False)[0]
    assert "test_loss" in trainer.test(module, data, verbose=False)[0]
    assert len(trainer.predict(module, data)) == 4


class Recording(Logger):
    def __init__(self) -> None:
        super().__init__(tempfile.mkdtemp())
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...


class StepLogged(Regression):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), on_step=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_err", F.l1_loss(self(batch[0]), batch[1]), on_step=True, on_epoch=False)


def test_on_step_values_in_validation_and_test_reach_the_loggers_per_batch(tmp_path):
    """As in Lightning: ``<name>_step`` after each evaluation batch at a per-dataloader batch count that goes on
    across the validations of a fit (none from the sanity check), ``<name>_epoch`` at the epoch's end."""
    logger = Recording()
    module = StepLogged()
    val = loader(regression_data(12, seed=3), 4)
    trainer = quiet_trainer(tmp_path, logger=logger, enable_telemetry=False, max_epochs=2, num_sanity_val_steps=2)
    trainer.fit(module, loader(regression_data(8), 4), val)
    steps = [(step, row["val_loss_step"]) for step, row in logger.rows if "val_loss_step" in row]
    assert [s for s, _ in steps] == [0, 1, 2, 3, 4, 5]
    module.eval()
    with torch.no_grad():
        x, y = val.dataset.tensors
        expected = [float(F.mse_loss(module(x[i:i + 4]), y[i:i + 4])) for i in (0, 4, 8)]
    assert [v for _, v in steps[3:]] == pytest.approx(expected)
    epochs = [row["val_loss_epoch"] for _, row in logger.rows if "val_loss_epoch" in row]
    assert len(epochs) == 2 and epochs[-1] == pytest.approx(sum(expected) / 3)
    logger.rows.clear()
    trainer.test(module, val, verbose=False)
    assert [step for step, row in logger.rows if "test_err" in row] == [0, 1, 2]


def test_sync_batchnorm_conversion_keeps_the_parameters_and_the_checkpoint_names():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm2d(2)))
    weight, names = net[1].weight, list(net.state_dict())
    convert_sync_batchnorm(net, tk.Trainer(logger=False, enable_progress_bar=False).strategy.data_comm())
    assert isinstance(net[1], SyncBatchNorm) and isinstance(net[2][0], SyncBatchNorm)
    assert net[1].weight is weight and list(net.state_dict()) == names
    x = torch.randn(6, 3)
    torch.testing.assert_close(net[1](x), F.batch_norm(x, None, None, weight, net[1].bias, True))  # one rank: plain


# -- two ranks -------------------------------------------------------------------------------------------------------

class BatchNormNet(Regression):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs))


def _sync_bn_run(batch: int, **kwargs: Any) -> dict[str, Any]:
    module, losses = BatchNormNet(), Losses()
    trainer = tk.Trainer(max_steps=4, seed=0, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=[losses], default_root_dir=tempfile.gettempdir(), **kwargs)
    trainer.fit(module, DataLoader(regression_data(64), batch_size=batch))
    state = {k: v.tolist() for k, v in module.state_dict().items()}
    module.eval()
    module.net[1].track_running_stats = False  # frozen as BaseFinetuning freezes it: evaluation still uses the
    with torch.no_grad():  # running statistics (torch's rule), on each rank alone
        evaluated = module.net(torch.linspace(-1, 1, 24).view(3, 8)).tolist()
    return {"state": state, "losses": trainer.strategy.all_gather_object(losses.losses), "eval": evaluated}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results: dict[str, Any] = {"sync_bn": _sync_bn_run(4, accelerator="cpu", devices=2, strategy="ddp",
                                                       sync_batchnorm=True, timeout_s=60, peer_timeout_s=0)}
    clock = Clock()  # rank 1's time runs out after its 3rd step, rank 0's never: both stop after the same step
    import trainkit.callbacks.timer as timer_module

    timer_module.time = clock  # type: ignore[assignment]
    trainer = tk.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_time={"seconds": 3}, max_steps=20,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False, timeout_s=60,
                         peer_timeout_s=0, callbacks=[Tick(clock, 1.0 if rank == 1 else 0.01)])
    trainer.fit(Regression(), DataLoader(regression_data(256), batch_size=4))
    results["max_time"] = trainer.strategy.all_gather_object([trainer.global_step, trainer.progress.stop_reason])
    if rank == 0:
        Path(out).write_text(json.dumps(results))


@pytest.mark.slow
def test_two_ranks_sync_batchnorm_equals_one_process_and_max_time_stops_them_together(tmp_path):
    out = tmp_path / "out.json"
    context = mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=240)
    assert all(p.exitcode == 0 for p in context.processes), [p.exitcode for p in context.processes]
    results = json.loads(out.read_text())
    reference = _sync_bn_run(8, accelerator="cpu")  # one process on the global batch of 8
    synced = results["sync_bn"]
    for rank_losses in synced["losses"]:  # each rank's loss is its half's; their mean is the global batch's
        assert len(rank_losses) == 4
    means = [(a + b) / 2 for a, b in zip(*synced["losses"], strict=True)]
    assert means == pytest.approx(reference["losses"][0], rel=1e-5, abs=1e-6)
    for name, value in reference["state"].items():
        torch.testing.assert_close(torch.tensor(synced["state"][name]), torch.tensor(value), rtol=1e-5, atol=1e-6,
                                   msg=name)
    torch.testing.assert_close(torch.tensor(synced["eval"]), torch.tensor(reference["eval"]), rtol=1e-5, atol=1e-6)
    assert results["max_time"] == [[4, "max_time"], [4, "max_time"]]  # rank 1's time up at step 3, agreed at step 4
