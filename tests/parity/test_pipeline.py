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
        Case("gpipe-validate-by-loss", "pipeline", {"microbatches": 4, "schedule": "gpipe"}, validate=True,
             per_rank_batch=8, model="loss_validated"),
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


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_world(2, _cases(2))


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_world(4, _cases(4))


@pytest.mark.parametrize("case", _cases(2), ids=lambda c: c.name)
def test_two_stages_match_single_process(two_ranks, case):
    assert_parity(two_ranks[case.name], run_reference(case, 2), case.tolerance())


@pytest.mark.parametrize("case", _cases(4), ids=lambda c: c.name)
def test_four_ranks_match_single_process(four_ranks, case):
    """4 stages, or 2 stages x 2 replicas."""
    assert_parity(four_ranks[case.name], run_reference(case, 4), case.tolerance())


@pytest.mark.parametrize("world", ["two_ranks", "four_ranks"])
def test_1f1b_bounds_activations_in_flight(world, request):
    """1F1B holds at most (stages - stage) micro-batches of activations on a stage; GPipe holds all."""
    results = request.getfixturevalue(world)
    stages = 2 if world == "two_ranks" else 4
    one_f, gpipe = results["1f1b-activations"].peaks, results["gpipe-activations"].peaks
    for rank in range(stages):
        assert one_f[rank]["micro_batches"] == stages - rank
        assert gpipe[rank]["micro_batches"] == 8
        # every micro-batch saves the same bytes for backward, so the peaks scale with the counts
        assert one_f[rank]["bytes"] * 8 == gpipe[rank]["bytes"] * (stages - rank)
    assert gpipe[0]["bytes"] > 0
