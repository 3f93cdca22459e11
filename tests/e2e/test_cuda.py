"""What only CUDA has: every strategy's one-rank path on the GPU, autocast with loss scaling, pinned
host buffers under offload, activation checkpointing, checkpoints that move between GPU and CPU, and
peak memory read from the CUDA allocator. Skipped where no GPU is visible (tests/conftest.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import trainkit as tk
from tests.e2e.test_activation_checkpointing import _saved_bytes_and_grads
from tests.helpers import Regression, adamw_groups, loader, quiet_trainer, regression_data
from tests.parity.harness import FP32, Case, assert_parity, run_case, run_reference
from trainkit.activation import apply_activation_checkpointing
from trainkit.callbacks import ModelCheckpoint
from trainkit.demo.gpt import Block, GPTConfig, TinyGPT
from trainkit_strategies import Environment, Precision, get_strategy

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda", 0)

ONE_RANK = [
    Case("ddp-acc2-clip", "ddp", accumulate=2, clip=0.05),
    Case("zero1-bf16", "zero1", {"bucket_mb": 0.0004}, precision="bf16-mixed", accumulate=2),
    Case("zero2-fp16", "zero2", {"bucket_mb": 0.0004}, precision="16-mixed", accumulate=2, clip=0.05,
         init_scale=1024.0),
    Case("zero_offload-bf16", "zero_offload", {"ratio": 0.5}, precision="bf16-mixed", clip=0.05),
    Case("zero_offload-32-num_items", "zero_offload", {}, accumulate=2, model="masked"),
    Case("zero3-gpt-checkpointing", "zero3", {"persistence_threshold": 0}, model="gpt", checkpointing=True),
    Case("fsdp-bf16-gpt", "fsdp", {}, precision="bf16-mixed", model="gpt"),
    Case("fsdp-offload", "fsdp", {"offload": True}, accumulate=2),
    Case("pipeline-1f1b", "pipeline", {"microbatches": 2}, per_rank_batch=8),
]


@pytest.mark.parametrize("case", ONE_RANK, ids=lambda c: c.name)
def test_every_strategy_runs_its_one_rank_path_on_cuda(case):
    """The W=1 code path of each strategy (communication skipped, same logic) on the GPU, against single."""
    assert_parity(run_case(case, 1, case.per_rank_batch, "cuda"), run_reference(case, 1), case.tolerance())


def _hand_loop(template: Regression, data: Any, steps: int, dtype: torch.dtype) -> tuple[Regression, float]:
    """torch's own recipe: autocast on CUDA, GradScaler for fp16 (its defaults are DynamicLossScaler's)."""
    model = copy.deepcopy(template).to(CUDA)
    opt = adamw_groups(model)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    for x, y in list(loader(data, 8))[:steps]:
        with torch.autocast("cuda", dtype=dtype):
            loss = F.mse_loss(model(x.to(CUDA)).float(), y.to(CUDA))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, scaler.get_scale() if scaler.is_enabled() else 1.0


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_autocast_and_loss_scaling_match_torch_amp(tmp_path, precision, dtype):
    data = regression_data(64)
    template = Regression()
    module = copy.deepcopy(template)
    trainer = quiet_trainer(tmp_path, accelerator="cuda", precision=precision, max_steps=8)
    trainer.fit(module, loader(data, 8))
    assert next(module.parameters()).device.type == "cuda"
    reference, scale = _hand_loop(template, data, 8, dtype)
    for (name, got), want in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if trainer.scaler is not None:  # the same overflow decisions, so the same scale
        assert trainer.scaler.scale == scale


def test_offload_pins_only_what_crosses_the_bus_at_its_exact_size(tmp_path):
    """Master weights and Adam state stay in ordinary host memory (they never cross the bus: pinning them would
    cost 12 bytes a parameter of page-locked memory for nothing); the gradient partition, which crosses both ways
    (gradients down, the updated compute-dtype parameters written over them going up), is page-locked at exactly
    its size (torch's pinned allocator would round it up to a power of two), and no other host buffer of the
    model's size exists."""
    module = Regression(dim=64, hidden=256)
    strategy = get_strategy("zero_offload")
    trainer = quiet_trainer(tmp_path, accelerator="cuda", strategy=strategy, precision="bf16-mixed", max_steps=3)
    trainer.fit(module, loader(regression_data(48, dim=64), 8))
    state = [t for s in strategy.optimizer.state.values() for t in s.values() if t.dim() > 0]
    pieces = [p for g in strategy.optimizer.param_groups for p in g["params"]]
    assert pieces and state
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in pieces + state)
    crossing = list(strategy.grads.buffers)
    assert crossing and all(t.is_pinned() for t in crossing)
    assert not strategy._master.host_low  # the parameters go back from the gradient partition
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in strategy.grads.buffers)
    assert not strategy._master.host_grad  # the partition is on the host already: no staging of gradients
    report = strategy.memory_report()
    assert report.device["master"] == 0 and report.device["optimizer"] == 0
    assert report.host["master"] > 0 and report.host["optimizer"] >= 2 * report.host["master"]
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in module.parameters())


def test_zero_offload_setup_never_holds_the_fp32_model_on_the_gpu(tmp_path):
    """A model built in host memory reaches the GPU bucket by bucket: the setup peak is the bf16 working copy plus
    one fp32 bucket, far below the 4 bytes a parameter of the fp32 model (the old setup moved it whole first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 16.8M parameters, 67 MB
    psi = sum(p.numel() for p in model.parameters())
    strategy = get_strategy("zero_offload", bucket_mb=4)
    strategy.setup_environment(Environment(device=CUDA))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    strategy.setup(model, torch.optim.AdamW(model.parameters()), Precision.from_name("bf16-mixed"))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2 * psi + 3 * 4 * 2**20 + 2**20, f"setup peak {peak} B for {psi} parameters"
    assert peak < 4 * psi


def test_activation_checkpointing_on_cuda_halves_saved_bytes_with_the_same_grads():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=16, block_size=64, n_layer=4, n_head=4, n_embd=64)).to(CUDA)
    tokens = torch.randint(0, 16, (8, 65), device=CUDA)
    plain_bytes, plain_grads = _saved_bytes_and_grads(model, tokens)
    checkpointed = copy.deepcopy(model)
    assert apply_activation_checkpointing(checkpointed, [Block]) == 4
    ckpt_bytes, ckpt_grads = _saved_bytes_and_grads(checkpointed, tokens)
    assert 0 < ckpt_bytes <= 0.5 * plain_bytes
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def _fit(root, accelerator: str, max_steps: int, ckpt_path: str | None = None) -> tuple[Regression, tk.Trainer]:
    module = Regression(scheduler=True)
    trainer = tk.Trainer(accelerator=accelerator, max_steps=max_steps, seed=0, logger=False, enable_progress_bar=False,
                         default_root_dir=root, callbacks=[ModelCheckpoint(every_n_train_steps=4)])
    trainer.fit(module, loader(regression_data(64), 4, shuffle=True), ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize(("first", "second"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(tmp_path, first, second):
    """Saved on one device, loaded on the other bit for bit, and continued to the numbers of a run that
    never moved (within fp32 tolerance: the two devices' kernels round differently)."""
    straight, _ = _fit(tmp_path / "straight", first, 8)
    _, half = _fit(tmp_path / "moved", first, 4)
    saved = {n: p.detach().cpu().clone() for n, p in half.module.named_parameters()}
    loaded = Regression(scheduler=True)
    evaluator = tk.Trainer(accelerator=second, logger=False, enable_progress_bar=False,
                           default_root_dir=tmp_path / "moved")
    evaluator.validate(loaded, loader(regression_data(8), 8), ckpt_path="last", verbose=False)
    for name, p in loaded.named_parameters():
        assert p.device.type == second and torch.equal(p.detach().cpu(), saved[name]), name
    moved, trainer = _fit(tmp_path / "moved", second, 8, ckpt_path="last")
    assert trainer.global_step == 8
    for (name, got), want in zip(moved.named_parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), **FP32, msg=lambda m, n=name: f"{n}: {m}")


def _peak(tmp_path, strategy: str, precision: str) -> tuple[int, int]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    module = Regression(dim=256, hidden=2048)
    chosen = get_strategy(strategy)
    trainer = quiet_trainer(tmp_path / strategy, accelerator="cuda", strategy=chosen, precision=precision, max_steps=2)
    trainer.fit(module, loader(regression_data(16, dim=256), 8))
    peak = torch.cuda.max_memory_allocated() - base
    return peak, chosen.memory_report().device_total


def test_peak_memory_from_the_cuda_allocator(tmp_path):
    """The allocator's peak covers the model state memory_report() counts, and moving the fp32 master and Adam
    state to the host shows in it: single holds 16 bytes a parameter at its peak (fp32 weights, gradients and
    two Adam moments), zero_offload about 8 (bf16 weights, gradients, reduced partition and bucket)."""
    psi = 256 * 2048 + 2048 + 2048 + 1
    single_peak, single_state = _peak(tmp_path, "single", "32")
    offload_peak, offload_state = _peak(tmp_path, "zero_offload", "bf16-mixed")
    assert single_peak >= 16 * psi and single_state >= 12 * psi  # gradients are freed after the step
    assert offload_peak >= offload_state
    assert single_peak - offload_peak >= 6 * psi
