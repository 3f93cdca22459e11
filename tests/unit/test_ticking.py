"""What runs on a clock, on a clock the test moves: the bars that redraw themselves while one item or one step takes
long, the heartbeat that declares a silent peer dead, and the one that names a rank the others wait for. No test here
sleeps or reads the wall clock."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from trainkit import work
from trainkit.callbacks.progress import QUIET_S, ProgressBar
from trainkit_strategies.communication.liveness import WARN_AFTER_S, Activity, Heartbeat, Peer


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
        self.said: dict[int, list[str]] = {r: [] for r in range(world_size)}
        self.doing = [Activity() for _ in range(world_size)]  # each rank's training thread
        self.hearts = [Heartbeat(store, r, world_size, dead_after_s, self.failures[r].append,
                                 clock=lambda: self.now, start=False, doing=self.doing[r], say=self.said[r].append)
                       for r in range(world_size)]

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


class Waits:
    """Ranks of a ``Store`` waiting in a collective since ``since`` s, as ``Comm._wait`` reports it every second."""

    def __init__(self, ranks: Store, waiting: list[int], timeout_s: float) -> None:
        self.ranks, self.waiting, self.timeout_s, self.since = ranks, waiting, timeout_s, ranks.now
        self.gave_up: dict[int, float] = {}

    def second(self) -> None:
        self.ranks.second(alive=list(range(len(self.ranks.hearts))))
        for r in self.waiting:
            if r not in self.gave_up and self.ranks.hearts[r].waiting(self.ranks.now - self.since, self.timeout_s):
                self.gave_up[r] = self.ranks.now - self.since


def test_a_rank_stuck_in_its_own_code_is_named_with_its_step_and_phase_a_warning_first_then_the_verdict():
    """Rank 1 sleeps in training_step at step 2 (its heartbeat goes on); rank 0 waits for it in the optimizer step's
    reduction. Once rank 1 has been there for half of timeout_s (its heartbeat sees a phase at its first beat after it
    began: 1 s here), rank 0 warns, once; past timeout_s it stops waiting with a verdict naming rank 1, its step and
    its phase, which rank 1 reads at its next beat, learning that it is the one blamed."""
    ranks = Store(2, dead_after_s=5.0)
    ranks.doing[1].enter("the training dataloader", 2)
    ranks.doing[1].enter("DiesAtStep.training_step")
    ranks.doing[0].enter("the optimizer step", 2)
    waits = Waits(ranks, waiting=[0], timeout_s=8.0)
    for _ in range(4):
        waits.second()
    assert ranks.said == {0: [], 1: []}
    waits.second()  # 5 s: rank 1 seen in training_step for 4 s, half of timeout_s
    assert ranks.said[0] == ["trainkit: warning (rank 0): rank 1 has been in DiesAtStep.training_step at step 2 for "
                             "4 s while the other ranks wait for it; the run stops if they wait timeout_s=8 s."]
    for _ in range(3):
        waits.second()
    assert len(ranks.said[0]) == 1 and ranks.failures == {0: [], 1: []} and waits.gave_up == {}
    waits.second()  # 9 s: past timeout_s
    verdict = ("rank 1 has been in DiesAtStep.training_step at step 2 for 8 s while the other ranks waited for it "
               "(timeout_s=8): look there for a hang or a deadlock, or raise timeout_s (--trainer.timeout_s) if it is "
               "that slow")
    assert waits.gave_up == {0: 9.0} and ranks.failures[0] == [verdict]
    assert ranks.said[1] == [] and not ranks.hearts[1].blamed
    ranks.second(alive=[1])
    assert ranks.failures[1] == [verdict] and ranks.hearts[1].blamed and not ranks.hearts[0].blamed


def test_a_long_wait_warns_once_for_each_phase_a_rank_is_stuck_in_and_never_for_a_rank_moving_on():
    """The default timeout_s (1800): the warning comes once the wait and the phase pass WARN_AFTER_S, once for one
    stuck phase, again when the rank waited for is stuck somewhere else, and never while it moves from phase to phase
    (slow, not stuck); a wait shorter than timeout_s fails nothing. The waiting rank reads the other ranks' beats (a
    read of every rank's key) a few times a minute, not every second."""
    ranks = Store(2, dead_after_s=15.0)
    ranks.doing[1].enter("the training dataloader", 7)
    ranks.doing[0].enter("the optimizer step", 7)
    looks, peers = [], ranks.hearts[0].peers
    ranks.hearts[0].peers = lambda: looks.append(ranks.now) or peers()
    waits = Waits(ranks, waiting=[0], timeout_s=1800.0)
    for _ in range(70):
        waits.second()
    ranks.doing[1].enter("MyCallback.on_train_batch_start")  # 70 s: the batch came; now it is stuck in a hook
    for _ in range(int(WARN_AFTER_S) + 10):
        waits.second()
    for i in range(300):  # then micro-batch after micro-batch, a second each
        ranks.doing[1].enter("Model.training_step" if i % 2 else "backward")
        waits.second()
    assert ranks.said[0] == [
        "trainkit: warning (rank 0): rank 1 has been in the training dataloader at step 7 for 60 s while the other "
        "ranks wait for it; the run stops if they wait timeout_s=1800 s.",
        "trainkit: warning (rank 0): rank 1 has been in MyCallback.on_train_batch_start at step 7 for 60 s while the "
        "other ranks wait for it; the run stops if they wait timeout_s=1800 s."]
    assert ranks.failures == {0: [], 1: []} and waits.gave_up == {}
    assert 6 <= len(looks) <= 20, looks  # 440 s of waiting, 380 of them past WARN_AFTER_S


def test_the_rank_named_is_the_one_furthest_behind_of_those_not_waiting_and_the_lowest_waiting_rank_warns():
    """Four ranks: 0 and 1 wait in a collective; 3 ran ahead to step 3 (under NCCL its host runs on until a device
    synchronisation, which is no wait of trainkit's); 2 is stuck at step 2 and is the one named, by rank 0 only."""
    ranks = Store(4, dead_after_s=15.0)
    for r, (phase, step) in enumerate([("the optimizer step", 2), ("the optimizer step", 2),
                                       ("Model.training_step", 2), ("Model.training_step", 3)]):
        ranks.doing[r].enter(phase, step)
    waits = Waits(ranks, waiting=[0, 1], timeout_s=10.0)
    for _ in range(11):
        waits.second()
    assert ranks.said[0] == ["trainkit: warning (rank 0): rank 2 has been in Model.training_step at step 2 for 5 s "
                             "while the other ranks wait for it; the run stops if they wait timeout_s=10 s."]
    assert ranks.said[1] == []
    assert waits.gave_up == {0: 11.0, 1: 11.0}
    assert ranks.failures[0][0].startswith("rank 2 has been in Model.training_step at step 2 for 10 s")
    assert ranks.failures[1] == ranks.failures[0]  # rank 1 read the verdict rank 0 wrote first
    ranks.second(alive=[2, 3])
    assert [h.blamed for h in ranks.hearts] == [False, False, True, False]


def test_when_every_rank_waits_nobody_is_named():
    """Ranks that called different collectives all wait: no rank is behind the others, so no warning and no verdict;
    the wait still ends at timeout_s."""
    ranks = Store(2, dead_after_s=15.0)
    ranks.doing[0].enter("the optimizer step", 4)
    ranks.doing[1].enter("Model.on_train_batch_end", 4)
    waits = Waits(ranks, waiting=[0, 1], timeout_s=6.0)
    for _ in range(7):
        waits.second()
    assert ranks.said == {0: [], 1: []} and ranks.failures == {0: [], 1: []}
    assert waits.gave_up == {0: 7.0, 1: 7.0}


def test_a_rank_outside_the_loops_is_named_so_and_a_finished_rank_is_nobody_s_laggard():
    ranks = Store(3, dead_after_s=15.0)
    ranks.doing[0].enter("the optimizer step", 1)
    ranks.hearts[2].finish()  # it ran to its end
    waits = Waits(ranks, waiting=[0], timeout_s=4.0)
    for _ in range(5):
        waits.second()
    assert ranks.failures[0] == [
        "rank 1 has been outside trainkit's loops (setting up, tearing down, or in the script's own code) for 5 s "
        "while the other ranks waited for it (timeout_s=4): look there for a hang or a deadlock, or raise timeout_s "
        "(--trainer.timeout_s) if it is that slow"]
    assert Peer.parse(2, b"done") is None


def test_a_wait_that_fails_by_itself_names_the_stuck_rank_only_after_half_of_timeout_s():
    """gloo's own timeout counts from when the collective was posted, so the wait can fail a little before timeout_s
    of waiting: it names the rank all the same. A wait that fails sooner (a peer's connection closed: it died) names
    nobody: that peer was not stuck."""
    ranks = Store(2, dead_after_s=15.0)
    ranks.doing[1].enter("Model.validation_step", 3)
    ranks.doing[0].enter("the optimizer step", 3)
    for _ in range(3):
        ranks.second(alive=[0, 1])
    assert ranks.hearts[0].waiting(3.0, timeout_s=8.0, failed=True)  # 3 s: the wait failed early
    assert ranks.failures[0] == []
    ranks.second(alive=[0, 1])
    ranks.hearts[0].waiting(7.5, timeout_s=8.0, failed=True)
    assert ranks.failures[0][0].startswith("rank 1 has been in Model.validation_step at step 3 for 3 s while the other "
                                           "ranks waited for it (timeout_s=8)")
