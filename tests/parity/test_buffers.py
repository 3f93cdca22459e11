"""BatchNorm statistics under every data-parallel strategy: rank 0's are broadcast after each step, so
all replicas validate and checkpoint the same values and switching strategy changes no number."""

from __future__ import annotations

import pytest

from tests.parity.harness import FP32, Case, assert_parity, run_plain, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

STRATEGIES = ["ddp", "zero1", "zero2", "zero_offload", "fsdp", "zero3"]
CASES = [Case(f"bn_{s}", s, steps=6, model="batchnorm", validate=True) for s in STRATEGIES]
CASES.append(Case("bn_ddp_local", "ddp", {"broadcast_buffers": False}, steps=6, model="batchnorm", validate=True))


@pytest.fixture(scope="module")
def results():
    return run_world(2, CASES)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replicas_share_rank_zero_statistics(results, strategy):
    result = results[f"bn_{strategy}"]
    assert result.val["buffer_spread"] == 0.0
    assert {"buffer:net.1.running_mean", "buffer:net.1.running_var"} <= result.params.keys()


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_every_strategy_matches_ddp_with_batchnorm(results, strategy):
    assert_parity(results[f"bn_{strategy}"], results["bn_ddp"], FP32)


def test_without_broadcast_each_replica_keeps_its_own_statistics(results):
    assert results["bn_ddp_local"].val["buffer_spread"] > 1e-3


def test_ddp_matches_a_plain_loop_with_batchnorm_per_replica(results):
    """ddp itself, held to data parallelism written out by hand (tests/parity/plain.py's "replicas"): each rank's
    strided part of the global batch normalised by its own statistics, rank 0's statistics kept; losses, gradients,
    parameters, running statistics and the validation metrics (sync_dist means and maxima, torchmetrics')."""
    case = next(c for c in CASES if c.name == "bn_ddp")
    plain = run_plain(case, 2, "replicas", split=2)
    plain.val["buffer_spread"] = 0.0  # one copy of the statistics: the replicas' spread is nothing
    assert set(plain.val) == {"val_loss", "val_max", "val_mse", "buffer_spread"}
    assert_parity(results["bn_ddp"], plain, FP32)
