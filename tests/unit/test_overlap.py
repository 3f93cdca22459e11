"""Communication overlaps backward and runs both ways at once, shown on a simulated gloo link (``tests/linkworld.py``).

Across a 1 Gb/s link the sharded strategies once lost their overlap (issue 40: the ring's sends posted before its
receives, so gloo's announcements of the receives queued behind this rank's own data and the link's two directions
took turns), and every parity test still passed: numbers do not show when bytes move. Here each rank's backward
takes ``TICK`` of a virtual clock per gradient, a direction of the link carries one byte per tick (far slower than
backward, as across nodes), and every engine that reduces gradients during backward must:

- have its first gradient reduction on the wire, with bytes moving in both directions, before backward produces its
  last gradient;
- post each later reduction before the one before it has arrived (a bucket never waits for its predecessor);
- keep both directions of the link carrying bytes from the first reduction's start to the last one's end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.linkworld import LinkWorld, Posted
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import MESSAGE_BYTES

WIDTH = 64  # a 64 x 64 fp32 weight: 16 KiB, so a direction carries a bucket in thousands of ticks
LAYERS = 4
TICK = 16  # virtual ticks of backward per gradient produced
BUCKET_MB = WIDTH * WIDTH * 4 / 2**20  # one weight per bucket (ddp, zero1/2, offload; zero3's gather buckets)
ENGINES = {
    "ddp": {"bucket_mb": BUCKET_MB},
    "zero1": {"bucket_mb": BUCKET_MB},
    "zero2": {"bucket_mb": BUCKET_MB},
    "zero_offload": {"bucket_mb": BUCKET_MB},
    "zero3": {"bucket_mb": BUCKET_MB, "persistence_threshold": 0},
    "fsdp": {},
}


class Blocks(nn.Module):
    """``LAYERS`` blocks of a linear layer and a tanh (fsdp's units: the repeated blocks); no biases, so every
    bucket is one weight, and no small reduction hides how a large one crosses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh())
                                    for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class Reduction:
    """A gradient reduction a rank started during backward: when, and the operations it posted."""

    at: float
    posted: list[Posted]

    @property
    def arrived(self) -> float:
        times = [p.arrived for p in self.posted]
        assert None not in times, "a reduction that never arrived"
        return max(times)  # type: ignore[type-var]


def train(world: LinkWorld, rank: int, name: str, options: dict) -> tuple[list[Reduction], list[float]]:
    """Two steps of ``name``; the second one's gradient reductions and the ticks its gradients were produced at."""
    env = Environment(device=torch.device("cpu"), rank=rank, local_rank=rank, world_size=world.world_size)
    strategy = get_strategy(name, **options)
    strategy.setup_environment(env, comm=world.comm(rank))
    model = Blocks()
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), Precision.from_name("32"))
    reductions: list[Reduction] = []
    produced: list[float] = []

    def traced(call: Callable[..., object]) -> Callable[..., object]:
        def reduce(*args: object, **kwargs: object) -> object:
            posted = world.capture()
            try:
                handle = call(*args, **kwargs)
            finally:
                world.release()
            if torch._C._current_graph_task_id() != -1:  # in backward
                reductions.append(Reduction(posted[0].at, posted))
            return handle
        return reduce

    for kind in ("reduce_scatter", "all_reduce"):  # the calls that reduce gradients (ddp: all_reduce)
        setattr(strategy.comm, kind, traced(getattr(strategy.comm, kind)))

    def backward_work(grad: torch.Tensor) -> None:
        world.compute(TICK)
        produced.append(world.now)

    for p in model.parameters():
        p.register_hook(backward_work)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the first step records the order of units (fsdp, zero3) and allocates
        reductions.clear()
        produced.clear()
        with strategy.forward_context():
            loss = F.mse_loss(model(x), x)
        strategy.backward(loss)
        strategy.reduce_gradients(1.0 / world.world_size)
        strategy.optimizer_step()
        strategy.zero_grad()
    return reductions, produced


@pytest.mark.parametrize("name", list(ENGINES))
def test_gradient_reductions_overlap_backward_in_both_directions(name: str) -> None:
    world = LinkWorld(2)
    results = world.run(lambda rank: train(world, rank, name, ENGINES[name]))
    for rank, (reductions, produced) in enumerate(results):
        assert len(reductions) >= LAYERS, f"{name}: rank {rank} reduced {len(reductions)} buckets during backward"
        last_gradient = max(produced)
        first = reductions[0]
        assert first.at < last_gradient, f"{name}: the first reduction started after backward's last gradient"
        late = [p.kind for p in first.posted if p.started is None or p.started >= last_gradient]
        assert not late, (f"{name}: rank {rank}'s first reduction had {late} not yet moving when backward produced "
                          f"its last gradient (tick {last_gradient}): the link does not run both ways at once")
        for k, (before, after) in enumerate(itertools.pairwise(reductions)):
            assert after.at < before.arrived, (
                f"{name}: rank {rank} started reduction {k + 1} at tick {after.at}, after reduction {k} arrived "
                f"(tick {before.arrived}): it waited for its predecessor")
    start = min(r[0][0].at for r in results)
    end = max(r[0][-1].arrived for r in results)
    for src, dst in ((0, 1), (1, 0)):
        busy = world.busy(src, dst, start, end)
        assert busy > 0.9, (f"{name}: from the first reduction's start to the last one's end (ticks {start:g}-{end:g}) "
                            f"the link {src} -> {dst} carried bytes {busy:.0%} of the time")


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_ring_exchange_moves_both_directions_at_once(world_size: int) -> None:
    """A ring reduce-scatter of 3 messages a rank per round: each round takes its bytes' time, not twice that, with
    the ranks posting in any order."""
    numel = 3 * MESSAGE_BYTES // 4 * world_size
    world = LinkWorld(world_size)

    def reduce(rank: int) -> tuple[float, torch.Tensor]:
        comm = world.comm(rank)
        x = torch.full((numel,), float(rank + 1))
        out = torch.empty(numel // world_size)
        comm.reduce_scatter(out, x)
        return world.now, out

    results = world.run(reduce)
    rounds = world_size - 1
    for now, out in results:
        assert torch.equal(out, torch.full_like(out, sum(range(1, world_size + 1))))
        assert now == pytest.approx(rounds * 3 * MESSAGE_BYTES), "the directions took turns"


def test_a_native_collective_takes_its_ring_time() -> None:
    """gloo's all-reduce of N bytes between 2 ranks: N bytes each way, both at once."""
    world = LinkWorld(2)

    def reduce(rank: int) -> float:
        t = torch.ones(1024)
        world.comm(rank).all_reduce(t)
        assert torch.equal(t, torch.full_like(t, 2.0))
        return world.now

    assert world.run(reduce) == [4096.0, 4096.0]

