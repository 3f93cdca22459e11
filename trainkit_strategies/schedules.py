"""Pipeline schedules as data: for each stage, the ordered list of actions it performs in one step.

An action is (kind, microbatch) with kind one of

    RECV_F  receive micro-batch ``mb``'s activation from the previous stage
    F       run forward of ``mb``
    SEND_F  send ``mb``'s activation to the next stage
    RECV_B  receive the gradient of ``mb``'s activation from the next stage
    B       run backward of ``mb``
    SEND_B  send the gradient of ``mb``'s input to the previous stage

so a schedule can be checked (and simulated) without any process group, and the executor in
``pipeline.py`` just walks the list. GPipe (Huang et al., 2019) runs every forward, then every backward;
1F1B (Narayanan et al., 2021, PipeDream-Flush) runs ``stages - stage - 1`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards, so a stage never holds
more than ``stages - stage`` micro-batches of activations. Both have the same bubble,
(p - 1) / (m + p - 1) of the step for p stages and m micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

KINDS = ("RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B")


class Action(NamedTuple):
    kind: str
    microbatch: int


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    out = [Action("RECV_F", mb)] if stage > 0 else []
    out.append(Action("F", mb))
    if stage < stages - 1:
        out.append(Action("SEND_F", mb))
    return out


def _backward(stage: int, stages: int, mb: int) -> list[Action]:
    out = [Action("RECV_B", mb)] if stage < stages - 1 else []
    out.append(Action("B", mb))
    if stage > 0:
        out.append(Action("SEND_B", mb))
    return out


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards (in the same micro-batch order)."""
    _check(stages, microbatches)
    return [
        [a for mb in range(microbatches) for a in _forward(s, stages, mb)]
        + [a for mb in range(microbatches) for a in _backward(s, stages, mb)]
        for s in range(stages)
    ]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """Warm up with ``stages - stage - 1`` forwards, then one forward / one backward, then drain."""
    _check(stages, microbatches)
    schedule = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [a for mb in range(warmup) for a in _forward(s, stages, mb)]
        for i in range(microbatches - warmup):
            actions += _forward(s, stages, warmup + i)
            actions += _backward(s, stages, i)
        actions += [a for mb in range(microbatches - warmup, microbatches) for a in _backward(s, stages, mb)]
        schedule.append(actions)
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"A schedule needs stages >= 1 and microbatches >= 1; got {stages}, {microbatches}.")


def max_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward did not yet, on one stage."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            live -= 1
    return peak


def simulate(schedule: Sequence[Sequence[Action]], forward_time: float = 1.0, backward_time: float = 1.0,
             ) -> tuple[float, float]:
    """Run the schedule with unit-free compute times and instant communication.

    Each stage executes its actions in order; a RECV waits for the matching SEND's data. Returns the
    makespan and the bubble fraction (idle share of stage-time).
    """
    stages = len(schedule)
    sent: dict[tuple[str, int, int], float] = {}  # (direction, to stage, mb) -> time available
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                kind, mb = schedule[s][position[s]]
                if kind in ("RECV_F", "RECV_B"):
                    key = ("F" if kind == "RECV_F" else "B", s, mb)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif kind == "F":
                    clock[s] += forward_time
                elif kind == "B":
                    clock[s] += backward_time
                elif kind == "SEND_F":
                    sent[("F", s + 1, mb)] = clock[s]
                else:
                    sent[("B", s - 1, mb)] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("The schedule deadlocks: a stage waits for data no stage will send.")
    makespan = max(clock)
    work = sum(forward_time * sum(a.kind == "F" for a in acts) + backward_time * sum(a.kind == "B" for a in acts)
               for acts in schedule)
    return makespan, 1.0 - work / (stages * makespan)


def partition(sizes: Sequence[int], stages: int) -> list[int]:
    """Split consecutive layers of the given sizes into ``stages`` non-empty groups minimising the largest
    group's total (exact, by dynamic programming); returns the number of layers per stage."""
    n = len(sizes)
    if not 1 <= stages <= n:
        raise ValueError(f"Cannot split {n} layers into {stages} non-empty pipeline stages.")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: first i layers in k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]
