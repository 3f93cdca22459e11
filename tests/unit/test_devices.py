"""Device placement checked without a GPU: every tensor trainkit creates names its device, epoch
aggregates stay on the device of the logged values, and asking for more GPUs than the machine has fails
before any process or process group exists."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tests.helpers import MaskedRegression, MaskedSequences, loader, masked_loss, masked_loss_of
from trainkit import Trainer, launcher
from trainkit.callbacks import ModelCheckpoint
from trainkit.results import Results
from trainkit_strategies import Environment, get_strategy

PACKAGES = tuple(str(Path(__file__).resolve().parents[2] / name) for name in ("trainkit", "trainkit_strategies"))
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.as_tensor,
             torch.randn, torch.rand, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor}


class FactoryAudit(TorchFunctionMode):
    """Records tensor factories called directly from trainkit's code without a ``device``: on a GPU they
    would put a tensor on the CPU beside CUDA ones (the bug class of a CPU weight stacked with a CUDA
    loss). ``torch.as_tensor`` of a tensor keeps that tensor's device and is fine."""

    def __init__(self) -> None:
        super().__init__()
        self.implicit: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            keeps_device = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
            caller = sys._getframe(1)
            if not keeps_device and caller.f_code.co_filename.startswith(PACKAGES):
                self.implicit.add(f"{caller.f_code.co_filename}:{caller.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


SCENARIOS = [
    ("single", {}, "16-mixed"),
    ("ddp", {}, "bf16-mixed"),
    ("zero1", {"bucket_mb": 0.0004}, "32"),
    ("zero2", {"bucket_mb": 0.0004}, "16-mixed"),
    ("zero_offload", {"ratio": 0.5}, "bf16-mixed"),
    ("zero3", {"persistence_threshold": 0}, "16-mixed"),
    ("fsdp", {}, "bf16-mixed"),
    ("pipeline", {"microbatches": 2}, "16-mixed"),
]


class SyncedMasked(MaskedRegression):
    """``num_items`` losses, and validation logged with sync_dist (mean and max): every aggregation path."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, _ = masked_loss(self.net, batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_max", loss, sync_dist=True, reduce_fx="max")

    def pipeline_validation_step(self, output: torch.Tensor, batch: Any, batch_idx: int) -> dict:
        return {"val_loss": masked_loss_of(output, batch)[0]}


@pytest.mark.parametrize(("name", "options", "precision"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_trainkit_names_the_device_of_every_tensor_it_creates(tmp_path, name, options, precision):
    """Fit (accumulation, clipping, loss scaling, num_items, synced validation, a checkpoint) and resume,
    under the audit: no trainkit line may create a tensor on an implicit device."""
    audit = FactoryAudit()

    def run(max_steps: int, ckpt_path: str | None) -> Trainer:
        trainer = Trainer(
            strategy=get_strategy(name, **options), precision=precision, max_steps=max_steps, accumulate_grad_batches=2,
            gradient_clip_val=0.5, val_check_interval=2, num_sanity_val_steps=1, logger=False,
            enable_progress_bar=False, default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(every_n_train_steps=2)],
        )
        trainer.fit(SyncedMasked(), loader(MaskedSequences(32), 4), loader(MaskedSequences(8, seed=1), 4),
                    ckpt_path=ckpt_path)
        return trainer

    with audit:
        run(2, None)
        resumed = run(4, "last")
    assert resumed.global_step == 4
    assert not audit.implicit, "tensors created without a device:\n" + "\n".join(sorted(audit.implicit))


def test_the_audit_catches_a_tensor_made_without_a_device():
    """Guards the test above: the pre-fix epoch aggregation (a CPU weight beside the logged value) is caught."""
    audit = FactoryAudit()
    results_file = str(Path(PACKAGES[0]) / "results.py")
    code = compile("torch.tensor(3.0, dtype=torch.float64)", results_file, "eval")
    with audit:
        eval(code, {"torch": torch})
    assert audit.implicit == {f"{results_file}:1 tensor"}


def test_epoch_aggregates_stay_on_the_logged_device():
    """Values logged on a non-CPU device (``meta`` stands in for CUDA) are summed, stacked and reduced on that
    device: mixing in a CPU tensor raises there, as it does on a GPU."""
    seen: list[torch.device] = []

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        seen.append(tensor.device)
        return torch.ones(tensor.shape, dtype=tensor.dtype, device="cpu")  # meta holds no values to read back

    results = Results(reduce)
    for step in range(3):
        value = torch.empty((), device="meta")
        results.log("loss", value, prog_bar=False, logger=True, on_step=False, on_epoch=True, reduce_fx="mean",
                    sync_dist=True, batch_size=4 + step)
        results.log("worst", value, prog_bar=False, logger=True, on_step=False, on_epoch=True, reduce_fx="max",
                    sync_dist=True, batch_size=None)
    assert results.entries["loss"].total.device.type == "meta"
    metrics = results.epoch_metrics()
    assert set(metrics) == {"loss", "worst"}
    assert [d.type for d in seen] == ["meta", "meta"]


@pytest.fixture
def one_gpu(monkeypatch):
    """This machine, pretending to have one visible GPU; starting a process or a process group fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process or process group was started")

    monkeypatch.setattr(launcher.subprocess, "Popen", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("accelerator", ["cuda", "auto"])
def test_more_devices_than_gpus_fails_before_launching(one_gpu, accelerator):
    with pytest.raises(RuntimeError) as err:
        Trainer(accelerator=accelerator, devices=2, logger=False)
    message = str(err.value)
    assert "2 processes on this machine would run on CUDA" in message and "1 GPU is visible" in message
    assert "--trainer.devices 1" in message and "--trainer.accelerator cpu" in message


@pytest.mark.slow
def test_more_ranks_than_gpus_under_torchrun_fails_before_the_process_group(one_gpu, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"2 processes on this machine would run on CUDA.*1 GPU is visible"):
        Trainer(accelerator="cuda", logger=False)


@pytest.mark.slow
def test_a_rank_past_the_last_gpu_is_refused(one_gpu):
    """No wrap-around (rank 1 on cuda:0 would meet NCCL's "Duplicate GPU detected")."""
    assert Environment.resolve_device("cuda", 0) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="2 processes on this machine would run on CUDA"):
        Environment.resolve_device("cuda", 1)
    assert Environment.resolve_device("cpu", 1) == torch.device("cpu")


@pytest.mark.slow
def test_cpu_runs_any_number_of_ranks_on_a_gpu_machine(one_gpu):
    Environment.check_gpu_count(4, "cpu")  # gloo on the CPU: no GPU needed



def test_mfu_peak_follows_what_the_matrix_products_run_on(monkeypatch):
    """bf16 on tensor cores; fp32 on TF32 tensor cores only when the matmul precision allows it, else plain fp32
    (an H100's fp32 MFU would read about 7x low against the TF32 peak); a V100 has no TF32."""
    from trainkit.callbacks.throughput import peak_flops_of

    gpu = torch.device("cuda", 0)
    assert peak_flops_of(gpu, torch.bfloat16, "NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops_of(gpu, torch.float32, "NVIDIA H100 80GB HBM3", "highest") == 66.9e12
    assert peak_flops_of(gpu, torch.float32, "NVIDIA H100 80GB HBM3", "high") == 494.7e12
    assert peak_flops_of(gpu, torch.float32, "Tesla V100-SXM2-32GB", "high") == 15.7e12
    assert peak_flops_of(gpu, torch.float32, "Some Future GPU", "high") is None
    assert peak_flops_of(torch.device("cpu"), torch.float32) is None


def test_float32_matmul_precision_is_a_trainer_option_and_idle_tensor_cores_are_named(monkeypatch):
    from trainkit.utils import tensor_cores_idle

    before = torch.get_float32_matmul_precision()
    try:
        Trainer(float32_matmul_precision="high", logger=False, enable_progress_bar=False)
        assert torch.get_float32_matmul_precision() == "high"
        with pytest.raises(ValueError, match="float32_matmul_precision must be"):
            Trainer(float32_matmul_precision="tf32", logger=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert not tensor_cores_idle(torch.device("cuda", 0))  # "high" uses them
        torch.set_float32_matmul_precision("highest")
        assert tensor_cores_idle(torch.device("cuda", 0))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
        assert not tensor_cores_idle(torch.device("cuda", 0))  # a V100 has none for fp32
        assert not tensor_cores_idle(torch.device("cpu"))
    finally:
        torch.set_float32_matmul_precision(before)
