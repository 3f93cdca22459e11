"""FSDP and ZeRO-3 (one engine, two policies) at 2 and 3 ranks against the single-process reference."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

ZERO3 = {"persistence_threshold": 0, "bucket_mb": 0.0004}

CASES = [
    case
    for name, options in (("fsdp", {}), ("zero3", ZERO3))
    for case in (
        Case(f"{name}-acc1", name, options),
        Case(f"{name}-acc4-clip", name, options, accumulate=4, clip=0.05),
        Case(f"{name}-acc4-num_items", name, options, accumulate=4, model="masked"),
        Case(f"{name}-bf16-acc4-clip", name, options, precision="bf16-mixed", accumulate=4, clip=0.05),
        Case(f"{name}-gpt-tied-checkpointing-acc2", name, options, model="gpt", checkpointing=True, accumulate=2),
        Case(f"{name}-gpt-bf16", name, options, model="gpt", precision="bf16-mixed"),
    )
] + [
    Case("fsdp-no-reshard-offload", "fsdp", {"reshard_after_forward": False, "offload": True, "ratio": 0.5},
         accumulate=2),
    Case("fsdp-no-sync-micro-steps", "fsdp", {"sync_micro_steps": False}, accumulate=4, clip=0.05),
    Case("zero3-persistent-small-params", "zero3", {"persistence_threshold": 16}, accumulate=2),
    Case("fsdp-bf16-true", "fsdp", {}, precision="bf16-true"),
    Case("fsdp-gpt-selective-checkpointing-acc2", "fsdp", {}, model="gpt", checkpointing="selective", accumulate=2),
    Case("fsdp-deferred-init-acc2", "fsdp", {}, model="deferred", accumulate=2),
    Case("zero3-deferred-init-clip", "zero3", ZERO3, model="deferred", clip=0.5),
    Case("fsdp-comm", "fsdp", {}, steps=3, record_comm=True),
    Case("fsdp-fp16-acc2-clip", "fsdp", {}, precision="16-mixed", accumulate=2, clip=0.05,
         init_scale=1024.0),
]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def world(request):
    return request.param, run_world(request.param, CASES)


@pytest.mark.parametrize("case", [c for c in CASES if not c.record_comm], ids=lambda c: c.name)
def test_sharded_matches_single_process(world, case):
    world_size, results = world
    assert_parity(results[case.name], run_reference(case, world_size), case.tolerance())


def test_fsdp_moves_3psi_per_step(world):
    """Two all-gathers (forward, backward) and one reduce-scatter of every parameter per step, less the second
    gather of the last unit (the last Linear, 16 -> 1: a weight flat and a bias flat, each padded to 16 elements per
    rank), which stays gathered from its forward to its backward."""
    world_size, results = world
    result = results["fsdp-comm"]
    flats = 4  # two Linear units, each with a weight (decayed) and a bias (not decayed) param group
    kept = 2 * 16 * world_size * 4
    assert len(result.comm) == 3
    for step, moved in enumerate(result.comm):
        assert moved.keys() == {"all_gather", "reduce_scatter"}
        assert moved["all_gather"] == 2 * moved["reduce_scatter"] - kept, step
        assert result.psi * 4 <= moved["reduce_scatter"] <= (result.psi + flats * 16 * world_size) * 4
