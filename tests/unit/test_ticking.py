"""What runs on a clock, on a clock the test moves: the bars that redraw themselves while one item or one step takes
long, and the heartbeat that declares a silent peer dead. No test here sleeps or reads the wall clock."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from trainkit import work
from trainkit.callbacks.progress import QUIET_S, ProgressBar
from trainkit_strategies.liveness import Heartbeat


class Clock:
    """A clock and a stop event in one: each ``wait(t)`` moves the clock on by ``t``; the event is set after
    ``waits`` waits. ``at`` runs things on the way (a print of the bar's own at some time)."""

    def __init__(self, waits: int, at: dict[float, object] | None = None) -> None:
        self.now, self.left, self.at = 0.0, waits, dict(at or {})

    def __call__(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.now = round(self.now + timeout, 6)
        for when in [t for t in self.at if t <= self.now]:
            self.at.pop(when)()
        self.left -= 1
        return self.left <= 0


def test_long_work_redraws_its_bar_every_tick_once_shown():
    clock = Clock(waits=20)
    redraws: list[float] = []
    bar = SimpleNamespace(start_t=0.0, refresh=lambda: redraws.append(clock.now))
    work._tick(bar, clock, clock)
    assert redraws[0] == work.DELAY_S  # nothing before the bar is shown
    assert [b - a for a, b in itertools.pairwise([*redraws, clock.now])] == [work.TICK_S] * len(redraws)
    assert clock.now == 20 * work.TICK_S


def test_the_training_bar_redraws_itself_only_when_quiet_for_quiet_s():
    """Silent from 0 s, the bar redraws at 2, 4, 6 s; a print of its own at 6.2 s (a step ended) puts the next redraw
    at 8.5 s, the first tick QUIET_S after that print; no stretch without output is longer than QUIET_S + a tick."""
    bar = SimpleNamespace(last_print_t=0.0)
    outputs: list[tuple[float, str]] = []

    def printed() -> None:
        bar.last_print_t = 6.2
        outputs.append((6.2, "print"))

    clock = Clock(waits=24, at={6.2: printed})
    bar.refresh = lambda: outputs.append((clock.now, "redraw"))
    ProgressBar._keep_alive(bar, clock, clock)
    outputs.sort()
    assert [t for t, what in outputs if what == "redraw"] == [2.0, 4.0, 6.0, 8.5, 10.5]
    times = [0.0, *(t for t, _ in outputs), clock.now]
    assert max(b - a for a, b in itertools.pairwise(times)) <= QUIET_S + 0.5


class Store:
    """One rendezvous store for the ranks of a test, each with its own clock-driven Heartbeat (no thread)."""

    def __init__(self, world_size: int, dead_after_s: float) -> None:
        store = dist.HashStore()
        self.now = 0.0
        self.failures: dict[int, list[str]] = {r: [] for r in range(world_size)}
        self.hearts = [Heartbeat(store, r, world_size, dead_after_s, self.failures[r].append,
                                 clock=lambda: self.now, start=False) for r in range(world_size)]

    def second(self, alive: list[int]) -> None:
        """One second on: every rank in ``alive`` beats, the highest first (each reads its neighbour's beat of this
        second)."""
        self.now += 1.0
        for r in sorted(alive, reverse=True):
            self.hearts[r].beat()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_neighbour_silent_longer_than_dead_after_s_is_declared_dead_and_every_rank_learns_it(world_size):
    ranks = Store(world_size, dead_after_s=5.0)
    for _ in range(3):
        ranks.second(alive=list(range(world_size)))
    last = world_size - 1  # it froze after its beat at 3 s; rank last - 1 watches it
    for _ in range(5):  # silent for 5 s: not yet
        ranks.second(alive=list(range(last)))
    assert all(not f for f in ranks.failures.values())
    ranks.second(alive=list(range(last)))  # 6 s
    verdict = f"rank {last} stopped answering: no heartbeat for 6 s (it died, was killed, or froze)"
    assert ranks.failures[last - 1] == [verdict]
    ranks.second(alive=list(range(last)))  # the others read the verdict at their next beat
    assert all(ranks.failures[r] == [verdict] for r in range(last))
    assert ranks.hearts[0].verdict() == verdict


def test_a_neighbour_that_finished_is_never_declared_dead():
    ranks = Store(2, dead_after_s=5.0)
    ranks.second(alive=[0, 1])
    ranks.hearts[1].finish()  # it ran to its end: the counter now says "done"
    for _ in range(60):
        ranks.second(alive=[0])
    assert ranks.failures == {0: [], 1: []}


def test_a_neighbour_that_never_beat_is_not_declared_dead_by_the_clock_alone():
    """A rank still starting (no beat written yet) is a slow start, not a death: only a counter that stopped moving
    is a silence (a rank that dies before joining is the launcher's to notice)."""
    ranks = Store(2, dead_after_s=5.0)
    for _ in range(60):
        ranks.second(alive=[0])
    assert ranks.failures[0] == []
