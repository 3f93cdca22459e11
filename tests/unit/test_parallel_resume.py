"""Checkpoints of ``strategy="parallel"`` are universal: a run under any layout (tensor-parallel parts stored as
strided pieces, FSDP shards of them, HSDP replicas, pipeline stages) resumes under any other layout or strategy,
and back, with the optimizer state, and the second step equals two steps of one process.

The demo GPT keeps its biases here (replicated across the tensor-parallel ranks, a row-parallel layer's added once)
and its head tied to the embedding (split the same way, stored once). Ranks are threads of this process computing
with real values (``tests/simworld.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from tests.simworld import CPU, SimWorld
from trainkit import checkpoint as ckpt
from trainkit.demo.gpt import DemoGPT
from trainkit.dispatch import HookDispatch
from trainkit.step import OptimizerStep, StepConfig
from trainkit_strategies import Environment, Precision, get_strategy

rank_zero_only.rank = 0
LAYOUTS = {  # name: (strategy, options, world size)
    "single": ("single", {}, 1),
    "fsdp@4": ("fsdp", {}, 4),
    "zero2@3": ("zero2", {"bucket_mb": 1e-4}, 3),
    "tp2@2": ("parallel", {"tp": 2, "sequence_parallel": False}, 2),
    "tp4@4": ("parallel", {"tp": 4}, 4),
    "tp2xdps2@4": ("parallel", {"tp": 2, "dp_shard": 2}, 4),
    "hsdp2x2@4": ("parallel", {"dp_replicate": 2, "dp_shard": 2}, 4),
    "pp2xtp2@4": ("parallel", {"pp": 2, "tp": 2, "microbatches": 2}, 4),
    "pp2xtp2xdps2@8": ("parallel", {"pp": 2, "tp": 2, "dp_shard": 2, "microbatches": 2}, 8),
}
PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b and "parallel" in (LAYOUTS[a][0], LAYOUTS[b][0])]


def gpt() -> DemoGPT:
    torch.manual_seed(0)
    return DemoGPT(vocab_size=16, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True, adam_eps=1e-3,
                   warmup_steps=2, max_steps=10)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (8, 16), generator=gen), torch.randint(0, 16, (8, 16), generator=gen))
            for _ in range(2)]


def run(layout: str, steps: list[int], load: Path | None, save: Path | None, layouts: dict | None = None,
        make: Callable[[], torch.nn.Module] = lambda: gpt(),
        data_of: Callable[[], list] = lambda: batches()) -> dict[str, torch.Tensor]:
    """``steps`` of ``layout`` (of ``layouts``: the GPT's here) from ``load``, saved to ``save``; the parameters."""
    name, options, world_size = (layouts or LAYOUTS)[layout]
    world = SimWorld(world_size, device=CPU)
    models = [make() for _ in range(world_size)]  # built here: the ranks' threads share one random generator
    data = data_of()

    def rank(r: int) -> dict[str, torch.Tensor]:
        strategy = get_strategy(name, **options)
        strategy.setup_environment(Environment(rank=r, world_size=world_size), comm=world.comm(r))
        module = models[r]
        strategy.setup(module, module.configure_optimizers()["optimizer"], Precision.from_name("32"))
        if load is not None:
            strategy.load_state(ckpt.CheckpointReader(load), ckpt.read_meta(load)["optimizer"]["param_groups"])
        step = OptimizerStep(strategy, StepConfig(1, gradient_clip_val=0.05), Precision.from_name("32"),
                             HookDispatch(None, module))
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
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for layout in {a for a, _ in PAIRS}:
        out[layout] = root / layout
        run(layout, [0], None, out[layout])
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return run("single", [0, 1], None, None)


@pytest.mark.parametrize("layout", sorted({a for a, _ in PAIRS}))
def test_a_checkpoint_stores_each_element_once(saved, layout):
    """Under tensor parallelism the row-parallel weights' parts are strided pieces; whole parameters (norms, biases)
    are written by one rank of the tensor-parallel group, HSDP shards by one replica, a weight tied across pipeline
    stages by its first stage: the pieces of every tensor add up to its size exactly, no element twice."""
    meta = ckpt.read_meta(saved[layout])
    proj = meta["tensors"]["model/model.blocks.0.attn.proj.weight"]["pieces"]
    if LAYOUTS[layout][1].get("tp") == 2:
        assert {tuple(p["strided"]) for p in proj} == {(0, 16, 32), (16, 16, 32)}  # [32, 32] split by columns
    for key, entry in meta["tensors"].items():
        numel = max(1, int(torch.tensor(entry["shape"]).prod()))
        assert sum(p["stop"] - p["start"] for p in entry["pieces"]) == numel, key


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_checkpoint_resumes_under_every_layout(pair, saved, reference):
    a, b = pair
    resumed = run(b, [1], saved[a], None)
    assert resumed.keys() == reference.keys()
    for name, want in reference.items():
        torch.testing.assert_close(resumed[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{a} -> {b}, {n}: {m}")
