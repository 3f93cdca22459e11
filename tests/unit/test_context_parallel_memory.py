"""Activations per rank under context parallelism: single's / cp, measured.

The demo GPT at a long sequence (s = 1024 with h = 64: the attention's inputs and outputs, q, k, v and its output,
are half of what a block saves) under ``strategy="parallel"`` with cp = 2 and 4, ranks as threads of this process
computing real values (``tests/simworld.py``), each through ``local_batch`` (its two chunks of the sequence) and the
strategy's forward context; ``ActivationMeter`` counts what one forward saves for backward. Every saved tensor is
per token (the ring keeps the rank's q, k, v, output and log-sum-exp, never a remote block), so a rank saves
single's / cp, within a few integers' bytes; under selective and full activation checkpointing too.
"""

from __future__ import annotations

import pytest
import torch

from tests.simworld import CPU, SimWorld
from trainkit.activation import apply_activation_checkpointing
from trainkit.demo.gpt import DemoGPT
from trainkit_strategies import ActivationMeter, Environment, Precision, get_strategy

V, S, H, A, L, B = 128, 1024, 64, 4, 2, 1


def _gpt() -> DemoGPT:
    torch.manual_seed(0)
    return DemoGPT(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)


def _measure(cp: int, method: str = "ring", checkpointing: str | None = None) -> list[tuple[int, float]]:
    world = SimWorld(cp, device=CPU)
    models = [_gpt() for _ in range(cp)]
    for model in models if checkpointing else []:
        apply_activation_checkpointing(model, checkpointing)

    def rank(r: int) -> tuple[int, float]:
        strategy = get_strategy("single") if cp == 1 else get_strategy("parallel", cp=cp, cp_method=method)
        strategy.setup_environment(Environment(device=CPU, rank=r, local_rank=r, world_size=cp), comm=world.comm(r))
        module = models[r]
        strategy.setup(module, torch.optim.AdamW(module.parameters()), Precision.from_name("32"))
        batch = strategy.local_batch(_batch())
        with ActivationMeter(exclude=module.parameters()) as meter, strategy.forward_context():
            loss = module.training_step(batch, 0)["loss"]
        strategy.backward(loss)
        return meter.bytes, loss.item()

    return world.run(rank)


@pytest.fixture(scope="module")
def single() -> int:
    return _measure(1)[0][0]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_activations_per_rank_are_single_over_cp(single, cp, method):
    ranks = _measure(cp, method)
    for saved, _ in ranks:
        assert saved == pytest.approx(single / cp, rel=0.10), (saved, single / cp)
        assert abs(saved - single / cp) < 1e-4 * single / cp  # in fact to a few bytes: only integer tensors differ
    assert len({saved for saved, _ in ranks}) == 1  # every rank holds as much


@pytest.mark.parametrize("checkpointing", ["selective", "full"])
def test_checkpointed_activations_per_rank_are_single_over_cp(checkpointing):
    """Selective checkpointing keeps attention across the group as one operator's output (never replaying the ring
    in backward), so what it keeps divides by cp as well; full checkpointing keeps the blocks' inputs."""
    one = _measure(1, checkpointing=checkpointing)[0][0]
    for saved, _ in _measure(2, checkpointing=checkpointing):
        assert abs(saved - one / 2) < 1e-3 * one / 2, (saved, one / 2)
