"""Per-rank model-state bytes against the ZeRO paper's accounting (§3.1, mixed precision + Adam):
DP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N; ZeRO-Offload moves the 12Ψ/N to host memory.

Ranks are simulated with torch's fake process group (collectives are no-ops), one world at a time in
this process: memory does not depend on what the collectives carry. The bytes are measured as the storages a step
leaves alive (tests/measure.py), against formulas whose padding is worked out from the model alone;
``memory_report()`` must agree with the measurement.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers import step_as_rank_1
from tests.measure import Alive
from trainkit_strategies import get_strategy
from trainkit_strategies.state.flat import ALIGN


@pytest.fixture
def fake_world(request):
    world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    yield world
    dist.destroy_process_group()


def _stepped(name: str, world: int, precision: str = "bf16-mixed"):
    """``name`` set up as rank 1 of ``world`` on a 2-layer MLP, after one step; and the bytes of the storages that
    came to life for it and are still held (a sweep of the garbage collector's tensors: tests/measure.py)."""
    with Alive() as alive:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(96, 320), nn.GELU(), nn.Linear(320, 96))
        strategy = step_as_rank_1(get_strategy(name), model, world, precision)
        return strategy, alive.bytes()


PSI = 96 * 320 + 320 + 320 * 96 + 96


def _padded(world: int) -> tuple[int, int, int]:
    """From the model alone: the elements of its flat buffers (one per optimizer group, each padded to a multiple
    of W·ALIGN: the two weight matrices, decayed, and the two biases), this rank's shard of them, and the largest
    buffer."""
    quantum = world * ALIGN
    groups = [96 * 320 + 320 * 96, 320 + 96]
    padded = [-(-n // quantum) * quantum for n in groups]
    return sum(padded), sum(padded) // world, max(padded)


def _adam_steps(strategy) -> int:
    return 4 * sum(1 for s in strategy.optimizer.state.values() if "step" in s)


@pytest.mark.parametrize("fake_world", [2, 4], indirect=True)
def test_zero1_holds_4psi_plus_12psi_over_n(fake_world):
    strategy, alive = _stepped("zero1", fake_world)
    padded, shard, _ = _padded(fake_world)
    assert padded - PSI < 2 * fake_world * ALIGN
    assert alive == 4 * padded + 12 * shard + _adam_steps(strategy)
    report = strategy.memory_report()
    assert report.device == {"params": 2 * padded, "grads": 2 * padded, "master": 4 * shard,
                             "optimizer": 8 * shard + _adam_steps(strategy), "buffers": 0}
    assert report.device_total == alive
    print(f"zero1 N={fake_world}: {alive} B alive for Ψ={PSI} (formula 4Ψ+12Ψ/N = {4 * PSI + 12 * PSI // fake_world})")


@pytest.mark.parametrize("fake_world", [2, 4], indirect=True)
def test_zero2_holds_2psi_plus_14psi_over_n(fake_world):
    strategy, alive = _stepped("zero2", fake_world)
    padded, shard, largest = _padded(fake_world)
    bucket = 2 * 2 * largest  # the two reduce-scatter buffers, taken in turn
    assert alive == 2 * padded + 14 * shard + bucket + _adam_steps(strategy)
    report = strategy.memory_report()
    assert report.device == {"params": 2 * padded, "grads": 2 * shard + bucket, "master": 4 * shard,
                             "optimizer": 8 * shard + _adam_steps(strategy), "buffers": 0}
    assert report.device_total == alive
    print(f"zero2 N={fake_world}: {alive} B alive for Ψ={PSI} (formula 2Ψ+14Ψ/N = {2 * PSI + 14 * PSI // fake_world})")


@pytest.mark.parametrize("fake_world", [2, 4], indirect=True)
def test_zero_offload_moves_master_and_optimizer_state_to_host(fake_world):
    """ZeRO-Offload: the device holds the bf16 working parameters and two gradient buckets in flight (no gradient
    partition, no fp32 copy); the host holds 14 bytes per element of the shard (fp32 master 4, Adam 8, the bf16
    gradient partition 2)."""
    strategy, alive = _stepped("zero_offload", fake_world)
    padded, shard, largest = _padded(fake_world)
    bucket = 2 * 2 * largest  # the two reduce-scatter buffers, taken in turn
    assert alive == 2 * padded + bucket + 14 * shard + _adam_steps(strategy)  # device and host: one memory here
    report = strategy.memory_report()
    assert report.device_total + report.host_total == alive
    assert report.device == {"params": 2 * padded, "grads": bucket, "master": 0, "optimizer": 0, "buffers": 0}
    assert report.host == {"params": 0, "master": 4 * shard, "optimizer": 8 * shard + _adam_steps(strategy),
                           "grads": 2 * shard}
    assert strategy._master.on_host == {u.index for u in strategy.buckets}


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_ddp_holds_16psi(fake_world):
    strategy, alive = _stepped("ddp", fake_world)
    assert alive == 16 * PSI + _adam_steps(strategy)
    assert strategy.memory_report().device_total == alive
