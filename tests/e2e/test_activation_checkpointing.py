"""Activation checkpointing on the demo GPT: at least half the saved-for-backward bytes, same grads."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import trainkit as tk
from tests.helpers import quiet_trainer
from trainkit.activation import apply_activation_checkpointing
from trainkit.demo.gpt import Block, DemoGPT, GPTConfig, TinyGPT
from trainkit.demo.markov import MarkovData
from trainkit_strategies import ActivationMeter


def _saved_bytes_and_grads(model: TinyGPT, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with ActivationMeter(exclude=model.parameters()) as meter:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return meter.bytes, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_blocks_halves_saved_bytes_with_identical_grads():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=16, block_size=64, n_layer=4, n_head=4, n_embd=64))
    tokens = torch.randint(0, 16, (8, 65))
    plain_bytes, plain_grads = _saved_bytes_and_grads(model, tokens)
    checkpointed = copy.deepcopy(model)
    assert apply_activation_checkpointing(checkpointed, [Block]) == 4
    ckpt_bytes, ckpt_grads = _saved_bytes_and_grads(checkpointed, tokens)
    print(f"saved for backward: {plain_bytes} B plain, {ckpt_bytes} B checkpointed ({ckpt_bytes / plain_bytes:.2f}x)")
    assert ckpt_bytes <= 0.5 * plain_bytes
    assert ckpt_bytes > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=0, msg=name)


def test_trainer_flag_applies_checkpointing_and_keeps_parameter_names(tmp_path):
    module = DemoGPT(n_layer=2, max_steps=3)
    names = [n for n, _ in module.named_parameters()]
    data = MarkovData(train_sequences=64, val_sequences=16, batch_size=8)
    trainer = quiet_trainer(tmp_path, max_steps=3, activation_checkpointing=[Block])
    trainer.fit(module, datamodule=data)
    assert all(getattr(b, "_trainkit_checkpointed", False) for b in module.model.blocks)
    assert [n for n, _ in module.named_parameters()] == names
    assert trainer.global_step == 3


def test_policy_matching_nothing_is_an_error(tmp_path):
    trainer = quiet_trainer(tmp_path, max_steps=1, activation_checkpointing=[torch.nn.GRU])
    try:
        trainer.fit(DemoGPT(), datamodule=MarkovData(train_sequences=16, batch_size=8))
    except ValueError as err:
        assert "matched no submodule" in str(err)
    else:
        raise AssertionError("expected a ValueError")
    assert isinstance(trainer, tk.Trainer)
