"""ZeRO-3 / FSDP memory: 16Ψ/N of model state per rank, and sharded initialisation that never holds
the full model (peak resident memory measured in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers import step_as_rank_1
from tests.measure import Alive
from trainkit_strategies import Environment, Precision, get_strategy

PROBE = Path(__file__).with_name("sharded_probe.py")
OPTIONS = {"fsdp": {}, "zero3": {"persistence_threshold": 0}}


@pytest.fixture
def fake_world(request):
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["fsdp", "zero3"])
@pytest.mark.parametrize("fake_world", [2, 4], indirect=True)
def test_model_state_is_16psi_over_n(fake_world, name):
    """Measured as the storages the step leaves alive (tests/measure.py): 16 bytes per element of this rank's
    shard, plus the two reduce-scatter buffers; ``memory_report()`` agrees, category by category."""
    with Alive() as alive:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(96, 320), nn.GELU(), nn.Linear(320, 320), nn.GELU(), nn.Linear(320, 96))
        psi = sum(p.numel() for p in model.parameters())
        strategy = step_as_rank_1(get_strategy(name, **OPTIONS[name]), model, fake_world)
        held = alive.bytes()
    layouts = [b.layout for b in strategy.buckets]
    shard = sum(f.piece for f in layouts)
    assert shard * fake_world - psi < len(layouts) * fake_world * 16  # padding only
    bucket = 2 * 2 * max(f.padded for f in layouts)  # the two reduce-scatter buffers, taken in turn
    steps = 4 * len(strategy.optimizer.state)  # Adam's step counters
    assert held == 16 * shard + bucket + steps
    report = strategy.memory_report()
    assert report.device_total == held
    assert report.device == {"params": 2 * shard, "grads": 2 * shard + bucket, "master": 4 * shard,
                             "optimizer": 8 * shard + steps, "buffers": 0}
    assert all(b.gathered.untyped_storage().nbytes() == 0 for b in strategy.buckets)  # nothing left gathered
    print(f"{name} N={fake_world}: {report.device_total} B for Ψ={psi} (16Ψ/N = {16 * psi // fake_world})")


def _probe(*args: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",  # large blocks go back to the OS when freed
           "PYTHONPATH": str(PROBE.parents[2])}
    proc = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_sharded_init_peak_is_a_shard_plus_one_unit(name):
    out = _probe(name, "4", "1", "blocks", "32")
    shard_bytes = 4 * out["shard_elements"]
    print(f"{name}: peak {out['peak_rss_delta'] / 2**20:.1f} MiB; shard {shard_bytes / 2**20:.1f} MiB + unit "
          f"{out['unit_fp32'] / 2**20:.1f} MiB; full model {out['full_fp32'] / 2**20:.1f} MiB")
    assert out["meta_left"] == 0
    assert out["peak_rss_delta"] <= 1.05 * (shard_bytes + out["unit_fp32"])
    assert out["peak_rss_delta"] < 0.4 * out["full_fp32"]


@pytest.mark.slow
def test_one_billion_parameter_gpt_at_64_ranks():
    out = _probe("fsdp", "64", "5", "gpt1b", "bf16-mixed")
    psi, shard = out["psi"], out["shard_elements"]
    assert psi > 1_000_000_000
    assert psi / 64 <= shard < psi / 64 + 64 * 16 * 50  # Ψ/N plus at most one padding quantum per flat
    assert out["device"]["params"] == 2 * shard and out["device"]["master"] == 4 * shard
    print(f"1.08B GPT at N=64: {shard} elements per rank, peak {out['peak_rss_delta'] / 2**20:.0f} MiB "
          f"of a {out['full_fp32'] / 2**30:.1f} GiB model")
    assert out["peak_rss_delta"] < 0.15 * out["full_fp32"]


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_offloaded_fp32_shards_do_not_keep_their_units_alive(name):
    """Under offload in fp32 the device keeps only the compute-dtype copy of its piece: a copy of its own, not a view
    of the unit's fp32 buffer (``.to()`` returns a view when the dtype is already right, which kept every unit whole
    on every GPU). Set up as on a GPU: ``meta`` stands in for it, host memory on the CPU."""
    from tests.simworld import META, SimWorld, on_device
    from trainkit_strategies import get_strategy

    world = SimWorld(2)

    def run(rank: int) -> None:
        strategy = get_strategy(name, offload=True)
        strategy.setup_environment(Environment(device=META, rank=rank, world_size=2), comm=world.comm(rank))
        torch.manual_seed(0)
        model = on_device(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]))
        strategy.setup(model, torch.optim.AdamW(model.parameters()), Precision.from_name("32"))
        for b in strategy.buckets:
            assert b.shard.device == META and b.shard.numel() == b.layout.piece
            assert b.shard.untyped_storage().nbytes() == b.layout.piece * 4, "the shard keeps its unit alive"

    world.run(run)
