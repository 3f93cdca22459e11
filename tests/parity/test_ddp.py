"""DDP at 2 and 3 ranks against the single-process reference, and its communication bytes."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

SMALL_BUCKETS = {"bucket_mb": 0.0004}  # ~400 B: the 8-16-1 MLP spreads over several buckets

CASES = [
    Case("acc1_validate", "ddp", SMALL_BUCKETS, validate=True, model="validated"),
    Case("acc4_clip", "ddp", SMALL_BUCKETS, accumulate=4, clip=0.05),
    Case("acc1_clip_one_bucket", "ddp", {}, clip=0.05),
    Case("acc4_num_items", "ddp", SMALL_BUCKETS, accumulate=4, model="masked"),
    Case("bf16_acc4_clip", "ddp", SMALL_BUCKETS, precision="bf16-mixed", accumulate=4, clip=0.05),
    Case("bf16_true_acc2", "ddp", SMALL_BUCKETS, precision="bf16-true", accumulate=2),
    Case("comm_acc4", "ddp", SMALL_BUCKETS, accumulate=4, steps=3, record_comm=True),
    # parameters unused on some ranks only, and one unused everywhere (its grad stays None)
    Case("unused_params", "ddp", {**SMALL_BUCKETS, "find_unused_parameters": True}, model="routed"),
    # ... with a collective of the step's own (the num_items total) between backward and the reduction
    Case("unused_on_some_ranks_num_items", "ddp", {"bucket_mb": 1e-5, "find_unused_parameters": True},
         model="routed_items", accumulate=2),  # a bucket per parameter
]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def world(request):
    return request.param, run_world(request.param, CASES)


@pytest.mark.parametrize("case", [c for c in CASES if not c.record_comm], ids=lambda c: c.name)
def test_ddp_matches_single_process(world, case):
    world_size, results = world
    assert_parity(results[case.name], run_reference(case, world_size), case.tolerance())


def test_validation_metrics_reduce_over_every_sample(world):
    """sync_dist means and torchmetrics see each of the 13 validation samples once, on any world size."""
    _, results = world
    assert {"val_loss", "val_max", "val_mse"} <= results["acc1_validate"].val.keys()


def test_ddp_communicates_psi_per_step_and_nothing_on_micro_steps(world):
    _, results = world
    result = results["comm_acc4"]
    per_micro = result.comm
    assert len(per_micro) == 12
    for i, moved in enumerate(per_micro):
        if (i + 1) % 4:
            assert sum(moved.values()) == 0, f"micro-step {i} communicated {moved}"
        else:
            assert moved == {"all_reduce": result.psi * 4}, f"step boundary {i} moved {moved}"
