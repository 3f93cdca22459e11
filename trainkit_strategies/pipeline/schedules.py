"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs in one step.

An action is (kind, microbatch, chunk), the chunk left out when it is 0 (see ``Action``), with kind one of

    RECV_F  receive the input of micro-batch ``mb`` to this rank's chunk ``chunk`` from the previous virtual stage
    F       run chunk ``chunk``'s forward of ``mb``
    SEND_F  send that forward's output to the next virtual stage
    RECV_B  receive the gradient of that output from the next virtual stage
    B       run chunk ``chunk``'s backward of ``mb``: the input gradient, and the weight gradients too unless the
            schedule has W actions
    SEND_B  send the gradient of the chunk's input to the previous virtual stage
    W       compute chunk ``chunk``'s weight gradients of ``mb`` (zero-bubble schedules only)

so a schedule can be checked (and simulated) without any process group, and the executor in
``pipeline.py`` just walks the list. ``chunk`` is always one of this rank's own model chunks; chunk ``c`` of
rank ``s`` is virtual stage ``virtual_stage(s, c, p) = c * p + s`` (Megatron's round-robin placement), so the
peer of a send from virtual stage ``k`` is ``rank_and_chunk(k + 1, p)`` forward and ``rank_and_chunk(k - 1, p)``
backward: the next (previous) rank, one chunk up (down) when wrapping between the last rank and rank 0.
Schedules with one chunk per rank use chunk 0 throughout, and their actions stay ``(kind, microbatch)`` pairs.

GPipe (Huang et al., 2019) runs every forward, then every backward; 1F1B (Narayanan et al., 2021,
PipeDream-Flush) runs ``stages - stage - 1`` warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards, so a stage never holds more than ``stages - stage`` micro-batches of
activations. Both have the same bubble, (p - 1) / (m + p - 1) of the step for p stages and m micro-batches.
Interleaved 1F1B (Narayanan et al., 2021, Section 2.2) gives each rank v chunks of 1/v of a stage, so the fill
and drain take 1/v as long: the bubble is (p - 1) / (v m + p - 1). ZB-H1 (Qi et al., 2024, "Zero Bubble
Pipeline Parallelism", Section 2.1) splits the backward into B and W, which nothing waits for, and lets W fill
the drain: with F, B and W taking equal time its idle time is a third of 1F1B's, at the same peak memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

KINDS = ("RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B", "W")


class Action(tuple):
    """``(kind, microbatch)``, or ``(kind, microbatch, chunk)`` when ``chunk`` is not 0.

    Chunk-0 actions stay pairs so that code unpacking ``kind, mb`` (the executor in ``pipeline.py``, the docs)
    keeps running one-chunk schedules, and fails loudly on the first action of another chunk.
    """

    __slots__ = ()

    def __new__(cls, kind: str, microbatch: int, chunk: int = 0) -> Action:
        return super().__new__(cls, (kind, microbatch, chunk) if chunk else (kind, microbatch))

    def __getnewargs__(self) -> tuple:  # copy and pickle rebuild through ``__new__``
        return tuple(self)

    def __repr__(self) -> str:
        return f"Action{tuple.__repr__(self)}"

    @property
    def kind(self) -> str:
        return self[0]

    @property
    def microbatch(self) -> int:
        return self[1]

    @property
    def chunk(self) -> int:
        return self[2] if len(self) == 3 else 0


def virtual_stage(rank: int, chunk: int, stages: int) -> int:
    """The position in the model of ``rank``'s chunk ``chunk``: chunks go round-robin, so rank 0 holds virtual
    stages 0, p, 2p, ... (Narayanan et al., 2021, Section 2.2)."""
    return chunk * stages + rank


def rank_and_chunk(virtual: int, stages: int) -> tuple[int, int]:
    """The rank holding virtual stage ``virtual``, and which of its chunks it is: the inverse of ``virtual_stage``."""
    return virtual % stages, virtual // stages


def _forward(stage: int, stages: int, mb: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    k = virtual_stage(stage, chunk, stages)
    out = [Action("RECV_F", mb, chunk)] if k > 0 else []
    out.append(Action("F", mb, chunk))
    if k < stages * chunks - 1:
        out.append(Action("SEND_F", mb, chunk))
    return out


def _backward(stage: int, stages: int, mb: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    k = virtual_stage(stage, chunk, stages)
    out = [Action("RECV_B", mb, chunk)] if k < stages * chunks - 1 else []
    out.append(Action("B", mb, chunk))
    if k > 0:
        out.append(Action("SEND_B", mb, chunk))
    return out


def _one_f_one_b_order(warmup: int, total: int) -> list[tuple[str, int]]:
    """A rank's ``i``-th forward and backward as ("F", i) and ("B", i): ``warmup`` forwards, then one forward /
    one backward, then the remaining backwards (PipeDream-Flush, Narayanan et al., 2021)."""
    steady = [step for i in range(total - warmup) for step in (("F", warmup + i), ("B", i))]
    return [("F", i) for i in range(warmup)] + steady + [("B", i) for i in range(total - warmup, total)]


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """All forwards, then all backwards (in the same micro-batch order); with several chunks per rank, chunk by
    chunk (every micro-batch through chunk 0, then chunk 1, ...; backwards from the last chunk), which works for
    any number of micro-batches."""
    _check(stages, microbatches, virtual_stages)
    v = virtual_stages
    return [
        [a for c in range(v) for mb in range(microbatches) for a in _forward(s, stages, mb, c, v)]
        + [a for c in reversed(range(v)) for mb in range(microbatches) for a in _backward(s, stages, mb, c, v)]
        for s in range(stages)
    ]


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Warm up with ``stages - stage - 1`` forwards, then one forward / one backward, then drain."""
    _check(stages, microbatches, virtual_stages)
    _one_chunk("1f1b", virtual_stages)
    return [
        [a for kind, i in _one_f_one_b_order(min(stages - s - 1, microbatches), microbatches)
         for a in (_forward if kind == "F" else _backward)(s, stages, i)]
        for s in range(stages)
    ]


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """1F1B over ``virtual_stages`` chunks per rank, as Megatron-LM orders it (Narayanan et al., 2021, Section 2.2).

    A rank's ``i``-th forward runs chunk ``(i // p) % v`` on micro-batch ``(i // (p v)) p + i % p``: groups of p
    micro-batches go through each chunk in turn, which is why m must be a multiple of p. Backwards take the
    chunks in reverse. The ``2 (p - rank - 1) + (v - 1) p`` warm-up forwards fill a rank's time until its first
    backward (micro-batch 0 on chunk v - 1) can come back, when a chunk's forward and backward take equal time.
    """
    _check(stages, microbatches, virtual_stages)
    if microbatches % stages:
        raise ValueError(f"interleaved_1f1b runs micro-batches in groups of stages={stages}, so microbatches must "
                         f"be a multiple of {stages}; got microbatches={microbatches}.")
    v, total = virtual_stages, microbatches * virtual_stages

    def step(stage: int, kind: str, i: int) -> list[Action]:
        mb, chunk = (i // (stages * v)) * stages + i % stages, (i // stages) % v
        if kind == "F":
            return _forward(stage, stages, mb, chunk, v)
        return _backward(stage, stages, mb, v - 1 - chunk, v)

    return [
        [a for kind, i in _one_f_one_b_order(min(2 * (stages - s - 1) + (v - 1) * stages, total), total)
         for a in step(s, kind, i)]
        for s in range(stages)
    ]


def zero_bubble(stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2024, Section 2.1): 1F1B with each backward split into B, the input gradient the
    previous stage waits for, and W, the weight gradients nothing waits for.

    Rank ``s`` runs a W after each B but ``s`` micro-batches behind (the paper starts W later the fewer warm-up
    forwards a rank has), so its last ``s`` Ws fill the drain while the earlier ranks' Bs arrive. Every rank then
    holds p micro-batches until their W, rank 0's peak as under 1F1B, and with F, B and W taking equal time
    (and m >= p) a rank idles p - 1 units against 1F1B's 3 (p - 1).
    """
    _check(stages, microbatches, virtual_stages)
    _one_chunk("zero_bubble", virtual_stages)
    schedule = []
    for s in range(stages):
        actions: list[Action] = []
        for kind, i in _one_f_one_b_order(min(stages - s - 1, microbatches), microbatches):
            if kind == "F":
                actions += _forward(s, stages, i)
            else:
                actions += _backward(s, stages, i)
                if i >= s:
                    actions.append(Action("W", i - s))
        schedule.append(actions + [Action("W", mb) for mb in range(max(microbatches - s, 0), microbatches)])
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zero_bubble": zero_bubble}


def schedule_for(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Schedule ``name`` for a batch of ``microbatches``: interleaved 1F1B runs groups of ``stages`` micro-batches, so
    a batch that is not a multiple (an epoch's short last one) runs as GPipe over the same chunks."""
    if name == "interleaved_1f1b" and microbatches % stages:
        return gpipe(stages, microbatches, virtual_stages)
    return SCHEDULES[name](stages, microbatches, virtual_stages)


def _check(stages: int, microbatches: int, virtual_stages: int) -> None:
    if stages < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"A schedule needs stages, microbatches and virtual_stages >= 1; got {stages}, "
                         f"{microbatches}, {virtual_stages}.")


def _one_chunk(name: str, virtual_stages: int) -> None:
    if virtual_stages != 1:
        raise ValueError(f"{name} runs one model chunk per rank; got virtual_stages={virtual_stages} "
                         "(interleaved_1f1b runs several).")


def max_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches (of any chunk) whose forward ran on one rank and whose activations are still kept:
    until the backward, or until the W pass in a schedule that has them, since weight gradients need them too."""
    until = "W" if any(a.kind == "W" for a in actions) else "B"
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == until:
            live -= 1
    return peak


def _receiver(rank: int, send: Action, stages: int) -> tuple[str, int, int, int]:
    """Where a SEND's data goes, as the key its RECV waits on: (direction, rank, chunk, micro-batch)."""
    k = virtual_stage(rank, send.chunk, stages) + (1 if send.kind == "SEND_F" else -1)
    return (send.kind[-1], *rank_and_chunk(k, stages), send.microbatch)


def simulate(schedule: Sequence[Sequence[Action]], forward_time: float = 1.0, backward_time: float = 1.0,
             weight_time: float = 1.0) -> tuple[float, float]:
    """Run the schedule with unit-free compute times and instant communication.

    Each rank executes its actions in order; a RECV waits for the matching SEND's data. The times are per
    action, so a chunk's under interleaving (1/v of a stage's); B takes ``backward_time`` whether or not the
    schedule splits off W. Returns the makespan and the bubble fraction (idle share of rank-time).
    """
    stages = len(schedule)
    cost = {"F": forward_time, "B": backward_time, "W": weight_time}
    sent: dict[tuple[str, int, int, int], float] = {}  # (direction, to rank, to chunk, mb) -> time available
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                a = schedule[s][position[s]]
                if a.kind in ("RECV_F", "RECV_B"):
                    key = (a.kind[-1], s, a.chunk, a.microbatch)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif a.kind in ("SEND_F", "SEND_B"):
                    sent[_receiver(s, a, stages)] = clock[s]
                else:
                    clock[s] += cost[a.kind]
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("The schedule deadlocks: a stage waits for data no stage will send.")
    makespan = max(clock)
    work = sum(cost.get(a.kind, 0.0) for actions in schedule for a in actions)
    return makespan, 1.0 - work / (stages * makespan)


_NEEDS = {"F": ("RECV_F",), "SEND_F": ("F",), "B": ("F", "RECV_B"), "SEND_B": ("B",), "W": ("B",)}


def check(schedule: Sequence[Sequence[Action]]) -> None:
    """Raise ValueError unless the schedule is whole and consistent, RuntimeError if it deadlocks: what the
    executor would otherwise find out mid-step, as a hang or a missing tensor on one rank.

    Every (micro-batch, virtual stage) has one F and one B, and one W if the schedule has any; each rank runs
    them after what they need (RECV_F before F before SEND_F; F and RECV_B before B before SEND_B and W); every
    SEND is received exactly once by the rank and chunk it goes to, and every RECV is sent.
    """
    stages = len(schedule)
    chunks = 1 + max(a.chunk for actions in schedule for a in actions)
    microbatches = 1 + max(a.microbatch for actions in schedule for a in actions)
    computes = ("F", "B", "W") if any(a.kind == "W" for actions in schedule for a in actions) else ("F", "B")
    edges = {("RECV_F", 0), ("RECV_B", stages * chunks - 1)}  # the model's input and its loss come from no peer
    sends: Counter[tuple[str, int, int, int]] = Counter()
    recvs: Counter[tuple[str, int, int, int]] = Counter()
    for s, actions in enumerate(schedule):
        done: set[Action] = set()
        for a in actions:
            if a.kind not in KINDS:
                raise ValueError(f"Rank {s} has an action of unknown kind {a!r}; kinds are {', '.join(KINDS)}.")
            if a in done:
                raise ValueError(f"Rank {s} runs {a!r} twice.")
            k = virtual_stage(s, a.chunk, stages)
            for need in _NEEDS.get(a.kind, ()):
                before = Action(need, a.microbatch, a.chunk)
                if before not in done and (need, k) not in edges:
                    raise ValueError(f"Rank {s} runs {a!r} before {before!r}.")
            done.add(a)
            if a.kind.startswith("SEND"):
                sends[_receiver(s, a, stages)] += 1
            elif a.kind.startswith("RECV"):
                recvs[(a.kind[-1], s, a.chunk, a.microbatch)] += 1
        missing = [Action(kind, mb, c) for mb in range(microbatches) for c in range(chunks) for kind in computes
                   if Action(kind, mb, c) not in done]
        if missing:
            raise ValueError(f"Rank {s} never runs {len(missing)} of its computations, e.g. {missing[:3]}.")
    if sends != recvs:
        raise ValueError(f"Sends and receives do not match, as (direction, to rank, to chunk, micro-batch): sent but "
                         f"never received {sorted(sends - recvs)}; received but never sent {sorted(recvs - sends)}.")
    simulate(schedule)


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
