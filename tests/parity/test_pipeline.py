"""Pipeline parallelism (GPipe and 1F1B; alone and with data parallelism) against one process."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world


def _cases(world: int) -> list[Case]:
    cases = []
    for schedule in ("1f1b", "gpipe"):
        for mb, batch in ((4, 4), (8, 8)):
            options = {"microbatches": mb, "schedule": schedule}
            cases += [
                Case(f"{schedule}-mb{mb}-acc2", "pipeline", options, accumulate=2, per_rank_batch=batch),
                Case(f"{schedule}-mb{mb}-gpt-tied", "pipeline", options, model="gpt", per_rank_batch=batch),
            ]
    cases += [
        Case("1f1b-num_items-clip", "pipeline", {"microbatches": 4}, model="masked", accumulate=2, clip=0.05),
        Case("1f1b-bf16", "pipeline", {"microbatches": 4}, precision="bf16-mixed"),
        Case("1f1b-validate", "pipeline", {"microbatches": 4}, validate=True, per_rank_batch=8),
        Case("1f1b-activations", "pipeline", {"microbatches": 8, "measure_activations": True}, per_rank_batch=8,
             steps=2),
        Case("gpipe-activations", "pipeline", {"microbatches": 8, "measure_activations": True, "schedule": "gpipe"},
             per_rank_batch=8, steps=2),
    ]
    if world == 4:  # 2 stages x 2 replicas
        cases += [
            Case("2x2-ddp-acc2-gpt", "pipeline", {"stages": 2, "microbatches": 4}, model="gpt", accumulate=2),
            Case("2x2-ddp-clip", "pipeline", {"stages": 2, "microbatches": 4, "schedule": "gpipe"}, clip=0.05),
            Case("2x2-zero1-acc2", "pipeline", {"stages": 2, "microbatches": 4, "data_parallel": "zero1"},
                 accumulate=2),
        ]
    return cases


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def world(request):
    return request.param, run_world(request.param, _cases(request.param))


@pytest.mark.parametrize("name", [c.name for c in _cases(4)])
def test_pipeline_matches_single_process(world, name):
    world_size, results = world
    cases = {c.name: c for c in _cases(world_size)}
    if name not in cases:
        pytest.skip(f"{name} needs 4 ranks (2 stages x 2 replicas); this world has {world_size}")
    case = cases[name]
    assert_parity(results[name], run_reference(case, world_size), case.tolerance())


def test_1f1b_bounds_activations_in_flight(world):
    """1F1B holds at most (stages - stage) micro-batches of activations on a stage; GPipe holds all."""
    world_size, results = world
    one_f, gpipe = results["1f1b-activations"].peaks, results["gpipe-activations"].peaks
    for rank in range(world_size):
        assert one_f[rank]["micro_batches"] == world_size - rank
        assert gpipe[rank]["micro_batches"] == 8
        # every micro-batch saves the same bytes for backward, so the peaks scale with the counts
        assert one_f[rank]["bytes"] * 8 == gpipe[rank]["bytes"] * (world_size - rank)
    assert gpipe[0]["bytes"] > 0
