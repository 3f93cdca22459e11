"""Bucket layout and the reduce-scatter buffers: the first bucket is small, so the first gradients start across the
wire early in backward; ZeRO-2 fills one bucket buffer while the other is still being reduce-scattered."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.state.flat import FIRST_BUCKET_BYTES, BucketReducer, FlatBucket, pack

MIB = 2**20


def _sizes(buckets: list[list[torch.Tensor]]) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in b) for b in buckets]


def test_the_first_bucket_closes_once_it_holds_first_bytes():
    # the reference MLP's gradients in backward order: (bias 512, weight 512 x 2048), (bias 2048, weight 2048 x 512)
    grads = [t for _ in range(4) for t in (torch.empty(512, device="meta"), torch.empty(512, 2048, device="meta"),
                                          torch.empty(2048, device="meta"), torch.empty(2048, 512, device="meta"))]
    plain = pack(grads, 25 * MIB)
    first = pack(grads, 25 * MIB, first_bytes=MIB)
    assert [len(b) for b in plain] == [13, 3]  # 6 weights (24 MiB) wait for 3/4 of backward
    assert [len(b) for b in first] == [2, 13, 1]  # the last layer alone, then 25 MiB buckets
    assert _sizes(first)[0] == 4 * MIB + 2048
    assert [p for b in first for p in b] == grads  # same order, nothing lost
    assert all(s <= 25 * MIB for s in _sizes(first))
    # a limit below first_bytes still bounds the first bucket
    assert _sizes(pack(grads[:4], MIB // 2, first_bytes=MIB)) == [2048, 4 * MIB, 8192, 4 * MIB]
    # every key (param group, dtype) gets a small first bucket of its own
    mixed = [torch.empty(MIB // 4, device="meta"), torch.empty(MIB // 4, dtype=torch.float16, device="meta")] * 8
    by_key = pack(mixed, 25 * MIB, key=lambda p: p.dtype, first_bytes=MIB)
    assert _sizes(by_key) == [MIB, MIB, 7 * MIB, 3 * MIB]
    assert [b[0].dtype for b in by_key] == [torch.float32, torch.float16, torch.float32, torch.float16]


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield 2
    dist.destroy_process_group()


def _buckets_of(name: str, env: Environment) -> tuple[nn.Module, list[list[nn.Parameter]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 64))
    strategy = get_strategy(name)
    strategy.setup_environment(env)
    strategy.setup(model, torch.optim.AdamW(model.parameters()), Precision.from_name("32"))
    params = [b.params for b in (strategy._buckets if name == "ddp" else strategy.buckets)]
    strategy.teardown()
    return model, params


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_strategies_start_with_a_small_bucket_of_the_last_layer_across_nodes(fake_world, name):
    model, params = _buckets_of(name, Environment(rank=1, world_size=fake_world, local_world_size=1))
    last = list(model[4].parameters()) + list(model[2].parameters())  # 128 KiB, then 2 MiB: crosses 1 MiB
    assert {id(p) for p in params[0]} == {id(p) for p in last}
    assert sum(p.numel() * 4 for p in params[0]) >= FIRST_BUCKET_BYTES
    assert {id(p) for p in params[1]} == {id(p) for p in model[0].parameters()}


@pytest.mark.parametrize("local_world_size", [2, 0], ids=["one-host", "unknown"])
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2"])
def test_cpu_ranks_of_one_host_start_with_a_whole_bucket(fake_world, name, local_world_size):
    """There a collective in flight takes the cores backward computes on: no early small bucket."""
    model, params = _buckets_of(name, Environment(rank=1, world_size=fake_world, local_world_size=local_world_size))
    assert [{id(p) for p in b} for b in params] == [{id(p) for p in model.parameters()}]


class _Flight:
    """A reduce-scatter in flight that records when it was waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


class _RecordingComm:
    active = True

    def __init__(self) -> None:
        self.log: list[str] = []
        self.sources: list[int] = []

    def reduce_scatter(self, out, source, async_op=False):
        self.sources.append(source.data_ptr())
        self.log.append(f"start {len(self.sources)}")
        return _Flight(self.log, str(len(self.sources)))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_fill_waits_only_for_the_reduction_that_last_used_its_buffer(depth):
    comm = _RecordingComm()
    reducer = BucketReducer(comm, torch.float32, torch.device("cpu"), 64, buffers=depth)
    bucket = FlatBucket.build([nn.Parameter(torch.zeros(8, 4))], ["w"], 2)
    shards = [torch.zeros(bucket.padded // 2) for _ in range(3)]
    for i, shard in enumerate(shards):
        bucket.params[0].grad = torch.full((8, 4), float(i + 1))
        source = reducer.fill(bucket)
        assert source[:32].eq(i + 1).all() and bucket.params[0].grad is None
        comm.log.append(f"filled {i + 1}")
        reducer.reduce(source, shard, accumulate=False)
    reducer.finish()
    if depth == 1:  # every fill waits for the one reduction before it
        assert comm.log == ["filled 1", "start 1", "wait 1", "filled 2", "start 2", "wait 2", "filled 3", "start 3",
                            "wait 3"]
        assert len(set(comm.sources)) == 1
    else:  # the second fill takes the other buffer at once; the third waits for the first reduction only
        assert comm.log == ["filled 1", "start 1", "filled 2", "start 2", "wait 1", "filled 3", "start 3", "wait 2",
                            "wait 3"]
        assert comm.sources[0] == comm.sources[2] != comm.sources[1]
    assert len(reducer.buffers) == depth
