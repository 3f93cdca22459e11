"""A checkpoint from any strategy at any world size resumes under any other, on models odd enough that some ranks
hold nothing but padding of a parameter group.

Every ordered pair of strategies is tried, at world sizes from 1 to 5 spread over the pairs: strategy A at W_a
takes one AdamW step (two param groups: decayed weights, undecayed biases of 7 + 3 elements, which at 3 to 5
ranks leave some ranks a piece of padding only) and saves a universal checkpoint; strategy B at W_b loads it with
the optimizer state and takes the second step. Both steps must equal two steps of one process on the same global
batches. The ranks of a world run as threads of this process with real values on the CPU
(``tests/simworld.py``), so the 64 pairs take seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from tests.simworld import CPU, SimWorld
from trainkit import checkpoint as ckpt
from trainkit.dispatch import HookDispatch
from trainkit.step import OptimizerStep, StepConfig
from trainkit_strategies import Environment, Precision, get_strategy

rank_zero_only.rank = 0
STRATEGIES = {
    "single": ({}, [1]), "ddp": ({}, [1, 2, 3, 4, 5]), "zero1": ({"bucket_mb": 1e-4}, [1, 2, 3, 4, 5]),
    "zero2": ({"bucket_mb": 1e-4}, [1, 2, 3, 4, 5]), "zero_offload": ({"bucket_mb": 1e-4}, [1, 2, 3, 4, 5]),
    "zero3": ({"persistence_threshold": 0}, [1, 2, 3, 4, 5]), "fsdp": ({}, [1, 2, 3, 4, 5]),
    "pipeline": ({"microbatches": 2}, [1, 2, 3]),  # as many stages as ranks: the MLP has 3 layers
}
PAIRS = [(a, b) for a in STRATEGIES for b in STRATEGIES]


class Odd(nn.Module):
    """5 -> 7 -> 3 -> 1 with tanh: weights of 35, 21 and 3 elements, biases of 7, 3 and 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.net[:2], self.net[2:4], self.net[4:]]

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(output, batch[1])

    def optimizer(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.05)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(11, 5, generator=gen), torch.randn(11, 1, generator=gen)) for _ in range(2)]


def run(name: str, world_size: int, steps: list[int], load: Path | None, save: Path | None) -> dict[str, torch.Tensor]:
    """``name`` on ``world_size`` thread ranks: optionally load ``load``, take the given global steps, optionally save
    to ``save``; the whole parameters after."""
    options, _ = STRATEGIES[name]
    world = SimWorld(world_size, device=CPU)
    models = [Odd() for _ in range(world_size)]  # built here: the ranks share one random generator
    data = batches()

    def rank(r: int) -> dict[str, torch.Tensor]:
        strategy = get_strategy(name, **options)
        strategy.setup_environment(Environment(rank=r, world_size=world_size), comm=world.comm(r))
        module = models[r]
        optimizer = module.optimizer()
        strategy.setup(module, optimizer, Precision.from_name("32"))
        if load is not None:
            meta = ckpt.read_meta(load)
            strategy.load_state(ckpt.CheckpointReader(load), meta["optimizer"]["param_groups"])
        step = OptimizerStep(strategy, StepConfig(1), Precision.from_name("32"), HookDispatch(None, module))
        for t in steps:
            x, y = data[t]
            replica, replicas = strategy.dp_rank, strategy.dp_size
            step.micro_step(module, (x[replica::replicas], y[replica::replicas]), t, boundary=True)
            assert step.step()
        if save is not None:
            meta = {"optimizer": {"class": "AdamW", "param_groups": strategy.optimizer_groups()}}
            ckpt.save(save.parent, save.name, strategy, meta, strategy.state_pieces(), {})
        return {k: v.detach().clone() for k, v in strategy.full_parameters().items()}

    return world.run(rank)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """Every (strategy, world size) a pair starts from, after one step, saved once."""
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for i, (a, _) in enumerate(PAIRS):
        sizes = STRATEGIES[a][1]
        key = (a, sizes[i % len(sizes)])
        if key not in out:
            out[key] = root / f"{a}-W{key[1]}"
            run(a, key[1], [0], None, out[key])
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return run("single", 1, [0, 1], None, None)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_checkpoint_resumes_under_every_strategy_and_world_size(pair, saved, reference):
    a, b = pair
    i = PAIRS.index(pair)
    sizes_a, sizes_b = STRATEGIES[a][1], STRATEGIES[b][1]
    w_a, w_b = sizes_a[i % len(sizes_a)], sizes_b[(2 * i + 1) % len(sizes_b)]
    resumed = run(b, w_b, [1], saved[(a, w_a)], None)
    assert resumed.keys() == reference.keys()
    for name, want in reference.items():
        torch.testing.assert_close(resumed[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{a} at W={w_a} -> {b} at W={w_b}, {n}: {m}")


def test_the_case_that_crashed_zero2_at_2_ranks_to_fsdp_at_3(tmp_path, reference):
    """Resumed under fsdp at 3 ranks, a rank holds only padding of the bias group (it raised IndexError)."""
    run("zero2", 2, [0], None, tmp_path / "ckpt")
    resumed = run("fsdp", 3, [1], tmp_path / "ckpt", None)
    for name, want in reference.items():
        torch.testing.assert_close(resumed[name], want, rtol=1e-5, atol=1e-6)


def test_some_ranks_hold_only_padding_of_a_group():
    """Guards the matrix: at 5 ranks the 11 bias elements leave ranks whose piece of that group is all padding."""
    world = SimWorld(5, device=CPU)
    models = [Odd() for _ in range(5)]

    def rank(r: int) -> int:
        strategy = get_strategy("fsdp")
        strategy.setup_environment(Environment(rank=r, world_size=5), comm=world.comm(r))
        strategy.setup(models[r], models[r].optimizer(), Precision.from_name("32"))
        return sum(not h.segments for h in strategy.state_layout().optimizer_holders)

    assert sum(world.run(rank)) > 0

