"""Pipeline schedules checked as data, with no process group."""

from __future__ import annotations

import pytest

from trainkit_strategies.pipeline.schedules import (
    SCHEDULES,
    Action,
    check,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    partition,
    rank_and_chunk,
    simulate,
    virtual_stage,
    zero_bubble,
)

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


INTERLEAVED_GRID = [(p, v, k * p) for p in (1, 2, 3, 4) for v in (1, 2, 3) for k in (1, 2, 4)]


@pytest.mark.parametrize(("stages", "chunks", "microbatches"), INTERLEAVED_GRID)
def test_interleaving_divides_fill_and_drain_by_the_chunks(stages, chunks, microbatches):
    makespan, bubble = simulate(interleaved_1f1b(stages, microbatches, chunks), 1 / chunks, 1 / chunks)
    assert makespan == pytest.approx(2 * microbatches + 2 * (stages - 1) / chunks)
    assert bubble == pytest.approx((stages - 1) / (chunks * microbatches + stages - 1))


@pytest.mark.parametrize(("stages", "microbatches"), [(p, k * p) for p in (1, 2, 3, 4) for k in (1, 2, 4)])
def test_interleaving_one_chunk_has_the_1f1b_bubble(stages, microbatches):
    assert simulate(interleaved_1f1b(stages, microbatches)) == simulate(one_f_one_b(stages, microbatches))


def test_interleaving_runs_groups_of_stages_micro_batches_per_chunk():
    rank0, rank1 = interleaved_1f1b(2, 4, 2)
    computes = [(a.kind, a.microbatch, a.chunk) for a in rank0 if a.kind in ("F", "B")]
    forwards = [(mb, c) for kind, mb, c in computes if kind == "F"]
    backwards = [(mb, c) for kind, mb, c in computes if kind == "B"]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    assert [kind for kind, _, _ in computes[:6]] == ["F"] * 5 + ["B"]  # 2 (p - 1) + (v - 1) p warm-up forwards
    # rank 1's chunk 0 (virtual stage 1) feeds rank 0's chunk 1 (virtual stage 2); rank 1's chunk 1 is the last
    assert rank_and_chunk(virtual_stage(1, 0, 2) + 1, 2) == (0, 1)
    assert Action("SEND_F", 0, 0) in rank1 and Action("RECV_F", 0, 1) in rank0
    assert not any(a.kind in ("SEND_F", "RECV_B") and a.chunk == 1 for a in rank1)
    assert not any(a.kind in ("RECV_F", "SEND_B") and a.chunk == 0 for a in rank0)


def test_virtual_stages_go_round_robin():
    assert [virtual_stage(0, c, 4) for c in range(3)] == [0, 4, 8]
    assert all(rank_and_chunk(virtual_stage(r, c, 4), 4) == (r, c) for r in range(4) for c in range(3))


def test_one_chunk_actions_stay_pairs_for_code_that_unpacks_kind_and_microbatch():
    assert all(len(a) == 2 for build in SCHEDULES.values() for actions in build(3, 6) for a in actions)
    assert Action("F", 3, 0) == Action("F", 3) == ("F", 3)
    assert Action("F", 3, 1).chunk == 1 and len(Action("F", 3, 1)) == 3


def test_zero_bubble_cuts_1f1b_idle_time_to_a_third():
    stages, microbatches = 4, 8
    zb_makespan, zb_bubble = simulate(zero_bubble(stages, microbatches), 1.0, 1.0, 1.0)
    makespan, bubble = simulate(one_f_one_b(stages, microbatches), 1.0, 2.0)  # 1F1B's B includes W
    print(f"p={stages} m={microbatches}: ZB-H1 makespan {zb_makespan:g}, bubble {zb_bubble:.4f}; "
          f"1F1B makespan {makespan:g}, bubble {bubble:.4f}")
    assert zb_bubble * zb_makespan <= 0.4 * bubble * makespan  # idle time per rank: 3 units against 9
    assert zb_bubble * zb_makespan == pytest.approx(bubble * makespan / 3)
    assert zb_bubble == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))


@pytest.mark.parametrize(("stages", "microbatches"), GRID)
def test_zero_bubble_holds_no_more_activations_than_1f1b(stages, microbatches):
    ours, ref = zero_bubble(stages, microbatches), one_f_one_b(stages, microbatches)
    awaiting_b = [max_in_flight([a for a in actions if a.kind != "W"]) for actions in ours]
    assert awaiting_b == [max_in_flight(actions) for actions in ref]
    # until W, every rank holds what rank 0 holds under 1F1B: the peak over ranks is 1F1B's (Section 2.1)
    assert [max_in_flight(actions) for actions in ours] == [max_in_flight(ref[0])] * stages


CHECKED = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zero_bubble") for p, m in GRID]
CHECKED += [("interleaved_1f1b", p, m, v) for p, v, m in INTERLEAVED_GRID]
CHECKED += [("gpipe", p, m, v) for p, v, m in INTERLEAVED_GRID] + [("gpipe", 4, 3, 2), ("gpipe", 3, 5, 3)]


@pytest.mark.parametrize(("name", "stages", "microbatches", "chunks"), CHECKED)
def test_every_schedule_is_whole_and_consistent(name, stages, microbatches, chunks):
    check(SCHEDULES[name](stages, microbatches, chunks))


def _edited(schedule: list[list[Action]], rank: int, drop: tuple[Action, ...] = (),
            append: tuple[Action, ...] = ()) -> list[list[Action]]:
    schedule[rank] = [a for a in schedule[rank] if a not in drop] + list(append)
    return schedule


def _swapped(schedule: list[list[Action]], rank: int, first: Action, second: Action) -> list[list[Action]]:
    i, j = schedule[rank].index(first), schedule[rank].index(second)
    schedule[rank][i], schedule[rank][j] = second, first
    return schedule


@pytest.mark.parametrize(("broken", "message"), [
    (_edited(interleaved_1f1b(2, 4, 2), 1, drop=(Action("SEND_F", 2, 0),)),
     r"received but never sent \[\('F', 0, 1, 2\)\]"),  # rank 0's chunk 1 waits for micro-batch 2 forever
    (_edited(one_f_one_b(3, 4), 2, append=(Action("SEND_F", 3),)),
     r"sent but never received \[\('F', 0, 1, 3\)\]"),  # the last stage sends past the end of the model
    (_edited(zero_bubble(3, 4), 2, drop=(Action("W", 1),)),
     r"Rank 2 never runs 1 of its computations, e.g. \[Action\('W', 1\)\]"),
    (_edited(gpipe(2, 2), 0, append=(Action("F", 0),)), r"Rank 0 runs Action\('F', 0\) twice"),
    (_swapped(zero_bubble(3, 4), 0, Action("B", 0), Action("W", 0)),
     r"Rank 0 runs Action\('W', 0\) before Action\('B', 0\)"),
    (_swapped(gpipe(2, 2), 1, Action("F", 1), Action("B", 1)),
     r"Rank 1 runs Action\('B', 1\) before Action\('F', 1\)"),
])
def test_check_names_what_is_broken(broken, message):
    with pytest.raises(ValueError, match=message):
        check(broken)


def test_check_reports_a_consistent_schedule_that_deadlocks():
    bad = [[Action("RECV_B", 0), Action("F", 0), Action("SEND_F", 0), Action("B", 0)],
           [Action("RECV_F", 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        check(bad)


def test_schedules_reject_arguments_they_cannot_run():
    with pytest.raises(ValueError, match="multiple of 4; got microbatches=6"):
        interleaved_1f1b(4, 6, 2)
    for name in ("1f1b", "zero_bubble"):
        with pytest.raises(ValueError, match=f"{name} runs one model chunk per rank; got virtual_stages=2"):
            SCHEDULES[name](2, 4, 2)
    with pytest.raises(ValueError, match="got 2, 4, 0"):
        interleaved_1f1b(2, 4, 0)


def test_the_pipeline_strategy_rejects_what_its_schedules_cannot_run():
    from trainkit_strategies import get_strategy

    with pytest.raises(ValueError, match="several model chunks per rank run under schedule 'interleaved_1f1b'"):
        get_strategy("pipeline", schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="'zero_bubble' computes weight gradients in a second autograd pass"):
        get_strategy("pipeline", schedule="zero_bubble", data_parallel="fsdp")
    with pytest.raises(ValueError, match="data_parallel must be one of ddp, zero1, zero2, fsdp; got 'zero3'"):
        get_strategy("pipeline", data_parallel="zero3")
    for data_parallel in ("ddp", "zero1", "zero2", "fsdp"):
        assert get_strategy("pipeline", data_parallel=data_parallel).data_parallel == data_parallel
