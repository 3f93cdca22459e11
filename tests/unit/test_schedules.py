"""Pipeline schedules checked as data, with no process group."""

from __future__ import annotations

import pytest

from trainkit_strategies.schedules import Action, gpipe, max_in_flight, one_f_one_b, partition, simulate

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 4, 8)]


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), GRID)
def test_every_forward_precedes_its_backward_and_runs_once(build, stages, microbatches):
    for actions in build(stages, microbatches):
        forwards = [a.microbatch for a in actions if a.kind == "F"]
        backwards = [a.microbatch for a in actions if a.kind == "B"]
        assert sorted(forwards) == sorted(backwards) == list(range(microbatches))
        for mb in range(microbatches):
            assert actions.index(Action("F", mb)) < actions.index(Action("B", mb))


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), GRID)
def test_sends_match_receives_in_order(build, stages, microbatches):
    schedule = build(stages, microbatches)
    for s in range(stages - 1):
        sent_f = [a.microbatch for a in schedule[s] if a.kind == "SEND_F"]
        recv_f = [a.microbatch for a in schedule[s + 1] if a.kind == "RECV_F"]
        sent_b = [a.microbatch for a in schedule[s + 1] if a.kind == "SEND_B"]
        recv_b = [a.microbatch for a in schedule[s] if a.kind == "RECV_B"]
        assert sent_f == recv_f == list(range(microbatches))
        assert sent_b == recv_b
    assert not any(a.kind in ("RECV_F", "SEND_B") for a in schedule[0])
    assert not any(a.kind in ("SEND_F", "RECV_B") for a in schedule[-1])


@pytest.mark.parametrize(("stages", "microbatches"), GRID)
def test_1f1b_keeps_at_most_stages_minus_index_micro_batches_in_flight(stages, microbatches):
    for s, actions in enumerate(one_f_one_b(stages, microbatches)):
        assert max_in_flight(actions) == min(stages - s, microbatches)
    assert all(max_in_flight(a) == microbatches for a in gpipe(stages, microbatches))


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), GRID)
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(build, stages, microbatches):
    makespan, bubble = simulate(build(stages, microbatches))
    assert makespan == 2 * (microbatches + stages - 1)
    assert bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_a_schedule_that_waits_forever_is_reported():
    bad = [[Action("RECV_B", 0), Action("F", 0), Action("SEND_F", 0), Action("B", 0)],
           [Action("RECV_F", 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(bad)


def test_partition_balances_parameters_exactly():
    assert partition([10, 10, 10, 10], 2) == [2, 2]
    assert partition([1, 1, 1, 30, 1, 1], 2) == [3, 3]
    counts = partition([5, 1, 1, 1, 1, 1], 3)
    assert counts[0] == 1 and min(counts) >= 1  # the largest stage is the 5 alone
    assert sum(partition(list(range(1, 11)), 4)) == 10
    with pytest.raises(ValueError, match="3 layers into 4"):
        partition([1, 2, 3], 4)
