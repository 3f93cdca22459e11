"""ResumableSampler: rank shards reproduce the single-process global order and resume mid-epoch."""

from __future__ import annotations

import pytest

from trainkit.data import ResumableSampler


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_batches_together_hold_the_single_process_batch(world):
    per_rank_batch, steps = 2, 5
    n = world * per_rank_batch * steps
    single = list(ResumableSampler(n, shuffle=True, seed=3))
    shards = [list(ResumableSampler(n, shuffle=True, seed=3, rank=r, world_size=world)) for r in range(world)]
    for t in range(steps):
        global_batch = single[t * world * per_rank_batch : (t + 1) * world * per_rank_batch]
        rank_batches = [s[t * per_rank_batch : (t + 1) * per_rank_batch] for s in shards]
        assert sorted(i for b in rank_batches for i in b) == sorted(global_batch)


def test_epochs_reshuffle_deterministically():
    a, b = ResumableSampler(20, True, seed=1), ResumableSampler(20, True, seed=1)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first
    assert sorted(first) == list(range(20))


def test_skip_resumes_mid_epoch_once():
    sampler = ResumableSampler(10, False, rank=1, world_size=2)
    sampler.skip(2)
    assert len(sampler) == 5
    assert list(sampler) == [5, 7, 9]
    assert list(sampler) == [1, 3, 5, 7, 9]


def test_uneven_lengths_pad_or_drop():
    padded = [list(ResumableSampler(5, False, rank=r, world_size=2)) for r in range(2)]
    assert padded == [[0, 2, 4], [1, 3, 0]]
    dropped = [list(ResumableSampler(5, False, rank=r, world_size=2, drop_last=True)) for r in range(2)]
    assert dropped == [[0, 2], [1, 3]]


def test_skip_applies_to_its_epoch_only():
    sampler = ResumableSampler(8, False)
    sampler.skip(8)  # an epoch resumed at its very end: its sampler is never drawn from
    sampler.set_epoch(1)
    assert list(sampler) == list(range(8))
