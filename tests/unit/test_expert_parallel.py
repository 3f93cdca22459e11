"""Expert parallelism's figures, measured: each rank holds 1/ep of the experts' parameters, gradients and optimizer
state (counted tensor by tensor against one process's), and the all-to-all bytes of a step are the formula's (tokens
x hidden x top-k x 4 bytes, twice forward and twice backward, per MoE layer) in ``Comm``'s counts; ranks are threads
of this process moving real values (``tests/simworld.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.simworld import CPU, SimWorld
from trainkit.moe import MoE
from trainkit_strategies import Environment, Precision, get_strategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from moe import Mixtral

DIM, LAYERS, TOP_K = 16, 2, 2


class Quiet(Mixtral):
    def training_step(self, batch: Any, batch_idx: int) -> dict:
        x, y = batch
        return {"loss": self._loss(self(x), y), "num_items": y.numel()}


def _model(experts: int = 4) -> Quiet:
    torch.manual_seed(0)
    return Quiet(vocab_size=16, max_seq_len=8, dim=DIM, n_layers=LAYERS, n_heads=2, n_kv_heads=2, hidden_dim=24,
                 experts=experts, top_k=TOP_K, warmup_steps=1, max_steps=10)


def _batch(rank: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 16, (size, 9), generator=torch.Generator().manual_seed(rank))
    return tokens[:, :-1], tokens[:, 1:]


def _expert_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the experts' weights, their gradients and their optimizer state, counted on the tensors."""
    experts = [p for m in module.modules() if isinstance(m, MoE) for p in (m.w1, m.w2, m.w3)]
    size = lambda t: t.numel() * t.element_size()
    return {"params": sum(size(p) for p in experts), "grads": sum(size(p.grad) for p in experts),
            "optimizer": sum(size(t) for p in experts for t in optimizer.state[p].values()
                          if torch.is_tensor(t) and t.dim())}  # the moments (not the step counts)


def _step(strategy: Any, module: torch.nn.Module, batch: Any) -> None:
    with strategy.forward_context():
        out = module.training_step(batch, 0)
    strategy.backward(out["loss"])
    strategy.reduce_gradients(1.0)
    strategy.optimizer_step()


@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_holds_one_ep_th_of_the_experts_and_moves_the_formulas_bytes(ep):
    alone = _model()
    optimizer = alone.configure_optimizers()["optimizer"]
    single = get_strategy("single")
    single.setup_environment(Environment())
    single.setup(alone, optimizer, Precision.from_name("32"))
    _step(single, alone, _batch(0))
    whole = _expert_bytes(alone, optimizer)

    world = SimWorld(ep, device=CPU)

    def rank(r: int) -> tuple[dict[str, int], int]:
        module = _model()
        strategy = get_strategy("parallel", ep=ep)
        strategy.setup_environment(Environment(rank=r, world_size=ep), comm=world.comm(r))
        optimizer = module.configure_optimizers()["optimizer"]
        strategy.setup(module, optimizer, Precision.from_name("32"))
        for comm in {id(c): c for c in strategy.comms()}.values():
            comm.stats.reset()
        _step(strategy, module, _batch(r))
        moved = sum(c.stats.bytes.get("all_to_all", 0) for c in {id(c): c for c in strategy.comms()}.values())
        return _expert_bytes(module, strategy.optimizer), moved

    results = world.run(rank)
    for held, _ in results:
        assert {k: v * ep for k, v in held.items()} == whole, (held, whole)  # exactly 1/ep of each
    tokens = 4 * 8 * ep  # the global batch's
    formula = tokens * DIM * TOP_K * 4 * 2 * 2 * LAYERS  # x hidden x top-k x fp32, 2 directions, fwd + bwd
    assert sum(moved for _, moved in results) == formula  # per rank on average (its share of what it received)


def test_capacity_routing_under_expert_parallelism_drops_what_one_process_drops():
    """Capacity is counted on each rank's tokens before they travel (GShard's local groups): at ep=2 a rank's output
    and its dropped assignments are those of one process running all the experts on that rank's tokens at the same
    capacity, drops and all."""
    torch.manual_seed(0)
    whole = MoE(DIM, 24, 4, top_k=TOP_K, capacity_factor=0.5)
    torch.nn.init.normal_(whole.router.weight, std=1.0)  # confident routers: some experts overflow
    world = SimWorld(2, device=CPU)
    inputs = [torch.randn(3, 8, DIM, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def rank(r: int) -> tuple[torch.Tensor, float, torch.Tensor]:
        import copy

        layer = copy.deepcopy(whole)
        strategy = get_strategy("parallel", ep=2)
        strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
        strategy.parallelize(layer)
        with strategy.forward_context():
            out = layer(inputs[r])
        return out.detach(), float(layer.dropped), layer.tokens_per_expert

    for r, (out, dropped, taken) in enumerate(world.run(rank)):
        want = whole(inputs[r])
        assert float(whole.dropped) > 0  # this capacity drops some
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        assert dropped == float(whole.dropped) and torch.equal(taken, whole.tokens_per_expert)
