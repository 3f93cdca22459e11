"""Short accumulation windows with an uneven last batch, under every strategy at 1 to 4 ranks.

Each replica reads 5 samples an epoch in batches of 4, so an epoch is one window of a batch of 4 and a batch of
1, cut short by the epoch's end (``accumulate_grad_batches=3``). With plain mean losses the window must step
like one batch of all its samples (each micro-batch's mean weighing by its samples), which is what the
single-process reference on batches of 4W and W samples does; weighing the two micro-batches equally, as trainkit
did before, moves some parameters the wrong way.
"""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_case, run_reference, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

SMALL = {"bucket_mb": 0.0004}  # several buckets per param group on the 8-16-1 MLP
STRATEGIES = [("ddp", {}), ("zero1", SMALL), ("zero2", SMALL), ("zero_offload", {**SMALL, "ratio": 0.5}),
              ("zero3", {"persistence_threshold": 0}), ("fsdp", {}), ("pipeline", {"microbatches": 2})]
CASES = [Case(f"{name}-uneven-window", name, options, accumulate=3, steps=2, samples_per_replica=5, clip=0.5)
         for name, options in STRATEGIES] + [
    # zero_offload stepping each bucket during the window's last backward (no clipping, no hook reading gradients)
    Case("zero_offload-overlap-uneven-window", "zero_offload", {**SMALL, "overlap_step": True}, accumulate=3, steps=2,
         samples_per_replica=5, probe_grads=False)]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["W2", "W3", "W4"])
def world(request):
    return request.param, run_world(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_uneven_window_steps_like_one_batch_of_its_samples(world, case):
    world_size, results = world
    result = results[case.name]
    assert len(result.losses) == 2
    assert_parity(result, run_reference(case, world_size), case.tolerance())
    assert result.steps_in_backward == (2 if not case.probe_grads else 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_uneven_window_on_one_rank(case):
    result = run_case(case, 1, case.per_rank_batch, "cpu")
    assert_parity(result, run_reference(case, 1), case.tolerance())
    assert result.steps_in_backward == (2 if not case.probe_grads else 0)
