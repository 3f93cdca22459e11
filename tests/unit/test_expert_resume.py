"""Checkpoints of expert-parallel runs are universal: each rank's block of experts is a piece of the whole stacked
weight, so a run at ep=2 (alone or with dp_shard=2) resumes at ep=4, beside tensor parallelism, under fsdp and on
one process, and back, with the optimizer state: the second step equals two steps of one process. Ranks are threads
of this process computing with real values (``tests/simworld.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from tests.unit import test_parallel_resume as parallel_resume
from tests.unit.test_expert_parallel import _model
from trainkit import checkpoint as ckpt

rank_zero_only.rank = 0
LAYOUTS = {  # name: (strategy, options, world size)
    "single": ("single", {}, 1),
    "fsdp@2": ("fsdp", {}, 2),
    "ep2@2": ("parallel", {"ep": 2}, 2),
    "ep4@4": ("parallel", {"ep": 4}, 4),
    "ep2xdps2@4": ("parallel", {"ep": 2, "dp_shard": 2}, 4),
    "ep2xtp2@4": ("parallel", {"ep": 2, "tp": 2}, 4),
}
SAVED = ("ep2@2", "ep2xdps2@4", "single")
PAIRS = [(a, b) for a in SAVED for b in LAYOUTS if a != b and "ep" in a + b]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 16, (8, 9), generator=gen) for _ in range(2)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run(layout: str, steps: list[int], load: Path | None, save: Path | None) -> dict[str, torch.Tensor]:
    return parallel_resume.run(layout, steps, load, save, LAYOUTS, _model, batches)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("expert_layouts")
    out = {}
    for layout in SAVED:
        out[layout] = root / layout
        run(layout, [0], None, out[layout])
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return run("single", [0, 1], None, None)


@pytest.mark.parametrize("layout", ["ep2@2", "ep2xdps2@4"])
def test_an_expert_parallel_checkpoint_stores_each_element_once(saved, layout):
    """Each rank's experts are a contiguous block of the whole stacked weight; the rest is written by one rank of
    the expert-parallel group: the pieces of every tensor add up to its size exactly."""
    meta = ckpt.read_meta(saved[layout])
    w1 = meta["tensors"]["model/model.layers.0.moe.w1"]
    assert w1["shape"] == [4, 16, 24]  # the whole layer's experts, whatever divided them
    for key, entry in meta["tensors"].items():
        numel = max(1, int(torch.tensor(entry["shape"]).prod()))
        assert sum(p["stop"] - p["start"] for p in entry["pieces"]) == numel, key


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_an_expert_parallel_checkpoint_resumes_under_every_layout(pair, saved, reference):
    a, b = pair
    resumed = run(b, [1], saved[a], None)
    assert resumed.keys() == reference.keys()
    for name, want in reference.items():
        torch.testing.assert_close(resumed[name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{a} -> {b}, {n}: {m}")
