"""Gradient bookkeeping that tests can check in one process: fp32 norms of fp16 gradients, scale factors
that do not outlive a skipped step, and which modules FSDP makes units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.norms import local_norm
from trainkit_strategies.sharding.fsdp import FSDPStrategy


def test_fp16_norm_above_fp16_range_is_finite():
    grads = [torch.full((10,), 60000.0, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    norm = local_norm(grads, 2.0, torch.device("cpu"))
    expected = torch.linalg.vector_norm(torch.cat([g.float() for g in grads]))
    assert torch.isfinite(norm) and torch.allclose(norm, expected)


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "fsdp", "zero3"])
def test_a_skipped_step_leaves_no_scale_behind(name):
    """fp16 overflow: gradients are reduced (scaled), then zeroed without a step; the next window's
    gradients must carry only their own scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    options = {"persistence_threshold": 0} if name == "zero3" else {}
    strategy = get_strategy(name, **options)
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), Precision.from_name("32"))
    x = torch.randn(3, 4)

    def window(scale: float) -> dict[str, torch.Tensor]:
        with strategy.forward_context():
            loss = model(x).sum()
        strategy.backward(loss)
        strategy.reduce_gradients(scale)
        return {k: v.clone() for k, v in strategy.full_gradients().items()}

    once = window(0.5)
    strategy.zero_grad()  # the step was skipped
    again = window(0.5)
    for key in once:
        torch.testing.assert_close(again[key], once[key], rtol=0, atol=0)


def test_default_fsdp_units_are_the_outermost_repeated_layers():
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(4)])
    units = FSDPStrategy().unit_modules(nn.Sequential(blocks))
    assert [u[0] for u in units] == list(blocks)
    holder = nn.Module()
    holder.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    assert [u[0] for u in FSDPStrategy(min_num_params=10).unit_modules(holder)] == list(holder.layers)
