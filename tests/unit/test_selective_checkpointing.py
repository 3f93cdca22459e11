"""Selective and every-k activation checkpointing: the same numbers as none, and the memory Korthikanti et al. (2022)
predict.

- Parity: loss and every gradient under "full", "selective", and both with ``every=2``, equal to no checkpointing, on
  the demo GPT and examples/llama.py (one process), under tp=2 with sequence parallelism (ranks as threads, so the
  recomputation re-issues its collectives), and through the Trainer (parameters after a few AdamW steps).
- Memory (``ActivationMeter``, which also counts what selective checkpointing keeps outside autograd's saved-tensor
  hooks) against bytes derived from the demo's shapes: per block, "full" keeps the block's input (4 sbh in fp32);
  "selective" keeps the input and the outputs of the matmuls (q/k/v 12 sbh, attention projection 4, MLP fc 16 and
  proj 4) and of the fused attention kernel (4 sbh and a log-sum-exp of 4abs bytes): 44 sbh + 4abs; none keeps
  64 sbh + 16sb (``test_tensor_parallel_memory``). With attention written out (the math kernel) none also keeps the
  s x s softmax (4as^2b) and selective does not: the 5as/h term the paper's selective recomputation removes.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import trainkit as tk
from tests.simworld import CPU, SimWorld
from trainkit.activation import apply_activation_checkpointing
from trainkit.demo.gpt import Block, DemoGPT
from trainkit_strategies import ActivationMeter, Environment, Precision, get_strategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from llama import Llama

V, S, H, A, L, B = 512, 128, 256, 8, 4, 4  # b x s > 3h: a linear's output outgrows its inputs
SBH, SB = S * B * H, S * B
VARIANTS = [("full", 1), ("selective", 1), ("full", 2), ("selective", 2)]


def _gpt(**kwargs: int) -> DemoGPT:
    torch.manual_seed(0)
    shape = dict(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H) | kwargs
    return DemoGPT(**shape)


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(vocab_size=96, max_seq_len=32, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=160)


def _batch(vocab: int, seq: int, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen)


def _step(module: torch.nn.Module, batch: tuple) -> tuple[float, dict[str, torch.Tensor], int]:
    with ActivationMeter(exclude=module.parameters()) as meter:
        loss = module.training_step(batch, 0)["loss"]
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in module.named_parameters()}, meter.bytes


def _kept_by_forward(base: torch.nn.Module, mode: str, batch: tuple) -> int:
    """The bytes a training forward allocates and has not freed when it returns (what backward will use), by the
    profiler's memory events: every allocation and free of the forward's thread, summed."""
    from torch.profiler import ProfilerActivity, profile

    module = copy.deepcopy(base)
    apply_activation_checkpointing(module, mode)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = module.training_step(batch, 0)["loss"]
    loss.backward()
    events = prof.events()  # the forward's thread only: a thread an earlier test left running (a heartbeat, a
    forward = Counter(e.thread for e in events).most_common(1)[0][0]  # background save) may allocate meanwhile
    return sum(event.self_cpu_memory_usage for event in events if event.thread == forward)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_every_mode_gives_the_gradients_of_no_checkpointing(model):
    base = _gpt(vocab_size=128, block_size=32, n_embd=64, n_head=4) if model == "gpt" else _llama()
    batch = _batch(128 if model == "gpt" else 96, 32)
    loss, grads, plain = _step(copy.deepcopy(base), batch)
    saved = {}
    for mode, every in VARIANTS:
        module = copy.deepcopy(base)
        wrapped = apply_activation_checkpointing(module, mode, every=every)
        assert wrapped == (len(base.model.blocks if model == "gpt" else base.model.layers) + every - 1) // every
        got_loss, got, saved[mode, every] = _step(module, batch)
        assert got_loss == pytest.approx(loss, abs=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=f"{model} {mode} every={every} {name}")
    # each keeps less than none and more than the one that recomputes more
    assert saved["full", 1] < saved["full", 2] < plain
    assert saved["full", 1] < saved["selective", 1] < saved["selective", 2] < plain


@pytest.mark.parametrize("attention", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], ids=["flash", "math"])
def test_selective_memory_is_between_full_and_none_as_derived(attention):
    base = _gpt()
    batch = _batch(V, S)
    with sdpa_kernel(attention):
        saved = {}
        for mode in (None, "full", "selective"):
            module = copy.deepcopy(base)
            if mode:
                apply_activation_checkpointing(module, mode)
            saved[mode] = _step(module, batch)[2]
    flash = attention is SDPBackend.FLASH_ATTENTION
    lse = 4 * A * B * S if flash else 0  # the fused kernel's per-row log-sum-exp, kept by selective
    softmax = 0 if flash else 4 * A * S * S * B  # the math kernel's s x s softmax, kept by none
    # per block: selective keeps 40 sbh (bytes, fp32) more than full, the matmuls' and attention's outputs
    assert saved["selective"] - saved["full"] == L * (40 * SBH + lse)
    # the same, measured without the meter (which selective's policy tells what it keeps): the bytes the forward
    # allocates and leaves allocated for backward, from torch's profiler
    with sdpa_kernel(attention):  # each mode once first: a first call's one-time allocations are not kept bytes
        kept = {mode: [_kept_by_forward(base, mode, batch) for _ in range(2)][-1] for mode in ("full", "selective")}
    assert kept["selective"] - kept["full"] == L * (40 * SBH + lse)
    # and recomputes the LayerNorms' outputs (2 x 4 sbh), their mean and rstd (16 sb), the GELU's output (16 sbh)
    # and, with the math kernel, the softmax the paper's selective recomputation is about
    assert saved[None] - saved["selective"] == L * (20 * SBH + 16 * SB + softmax)


def test_selective_under_tensor_and_sequence_parallelism_matches_no_checkpointing():
    """The recomputed forward re-issues the sequence-parallel all-gathers; ranks as threads of this process."""
    batch = _batch(128, 32)
    models = {mode: [_gpt(vocab_size=128, block_size=32, n_embd=64, n_head=4) for _ in range(2)]
              for mode in (None, "selective", "full")}

    def rank(r: int, mode: str | None) -> tuple[float, dict[str, torch.Tensor]]:
        module = models[mode][r]
        if mode:
            apply_activation_checkpointing(module, mode)  # as the Trainer does: before the strategy's setup
        strategy = get_strategy("parallel", tp=2, sequence_parallel=True)
        strategy.setup_environment(Environment(device=CPU, rank=r, local_rank=r, world_size=2), comm=world.comm(r))
        strategy.setup(module, torch.optim.AdamW(module.parameters()), Precision.from_name("32"))
        with strategy.forward_context():
            loss = module.training_step(batch, 0)["loss"]
        strategy.backward(loss)
        strategy.reduce_gradients(1.0)
        return loss.item(), {n: p.grad.clone() for n, p in module.named_parameters()}

    results = {}
    for mode in models:
        world = SimWorld(2, device=CPU)
        results[mode] = world.run(lambda r, m=mode: rank(r, m))
    for mode in ("selective", "full"):
        for r in range(2):
            loss, grads = results[mode][r]
            assert loss == pytest.approx(results[None][r][0], abs=1e-6)
            for name, g in results[None][r][1].items():
                torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=f"{mode} rank {r} {name}")


def _fit(tmp_path: Path, name: str, **trainer: object) -> dict[str, torch.Tensor]:
    gpt = _gpt(vocab_size=128, block_size=32, n_embd=64, n_head=4)
    x, y = _batch(128, 32, batch=12)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    tk.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=str(tmp_path / name), **trainer).fit(gpt, loader)
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}


def test_trainer_takes_selective_and_every(tmp_path):
    reference = _fit(tmp_path, "none")
    for option in ({"activation_checkpointing": "selective"},
                   {"activation_checkpointing": "selective", "activation_checkpointing_every": 2},
                   {"activation_checkpointing": [Block], "activation_checkpointing_every": 3}):
        got = _fit(tmp_path, str(len(option)), **option)
        for name, p in reference.items():
            torch.testing.assert_close(got[name], p, atol=1e-6, rtol=1e-5, msg=f"{option} {name}")


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="not a recompute mode"):
        tk.Trainer(activation_checkpointing="everything")
    with pytest.raises(ValueError, match="positive integer"):
        tk.Trainer(activation_checkpointing="full", activation_checkpointing_every=0)
    with pytest.raises(ValueError, match="repeated blocks"):
        apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), "selective")
