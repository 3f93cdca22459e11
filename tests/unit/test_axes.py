"""Axes as transforms (``trainkit_strategies/axis.py``): ``ParallelStrategy`` applies every axis in one loop per
hook, in a fixed order, so an axis registered in ``AXES`` takes part in every part of a step without touching
anything else; the tp/ep gradient sums are one ``Comm.all_reduce_coalesced``; and what a layer needs at run time is
installed on the module (a MoE layer dispatches across its expert-parallel group outside any strategy context, and
auxiliary losses reach the collector of their own module only).

Ranks are threads of this process computing with real values on the CPU (``tests/simworld.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.simworld import CPU, SimWorld
from trainkit.moe import MoE
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.axis import Axis
from trainkit_strategies.experts.auxiliary import collecting
from trainkit_strategies.parallel import strategy as parallel


def _env(r: int, world: int) -> Environment:
    return Environment(device=CPU, rank=r, local_rank=r, world_size=world)


def test_all_reduce_coalesced_sums_every_tensor_in_one_collective_per_dtype():
    world = SimWorld(2, device=CPU)

    def rank(r: int) -> tuple[list[torch.Tensor], dict, dict]:
        comm = world.comm(r)
        tensors = [torch.full((3,), r + 1.0), torch.full((2, 2), 10.0 * (r + 1)),
                   torch.full((4,), r + 1.0, dtype=torch.bfloat16), torch.full((1,), -1.0 * r)]
        comm.all_reduce_coalesced(tensors)
        return tensors, dict(comm.stats.calls), dict(comm.stats.bytes)

    for tensors, calls, moved in world.run(rank):
        assert [t.tolist() for t in tensors] == [[3.0] * 3, [[30.0] * 2] * 2, [3.0] * 4, [-1.0]]
        assert tensors[2].dtype == torch.bfloat16
        assert calls["all_reduce"] == 2  # fp32 and bf16: one flat buffer each
        assert moved["all_reduce"] == (3 + 4 + 1) * 4 + 4 * 2


class Recording(Axis):
    """An axis registered in ``AXES`` that only records which hooks ran."""

    name = "fake"

    def __init__(self, comm, calls: list[str]) -> None:
        super().__init__(comm)
        self.calls = calls

    @classmethod
    def of(cls, layout):
        return cls(layout.mesh.comm("tp"), layout.recorded)

    def transform(self, module, device):
        self.calls.append("transform")

    def local_module(self, module, optimizer, engine, whole_shape, shapes):
        self.calls.append("local_module")
        return module

    def bind(self, module, names, engine, whole_shapes):
        self.calls.append(f"bind {sorted(names.values())}")

    def opened(self, module, engine):
        self.calls.append("opened")

    def local_batch(self, batch):
        self.calls.append("local_batch")
        return batch * 2

    def reduce_gradients(self, engine):
        self.calls.append("reduce_gradients")

    def counted_elsewhere(self):
        self.calls.append("counted_elsewhere")
        return []

    def combine_norm(self, norm, norm_type):
        self.calls.append("combine_norm")
        return norm

    def state(self, layout, group_names):
        self.calls.append("state")
        return layout

    def whole(self, tensors):
        self.calls.append("whole")
        return tensors

    def comms(self):
        return [self.comm]

    def describe(self):
        return "recorded"


def test_an_axis_registered_in_axes_takes_part_in_every_hook_in_order(monkeypatch):
    monkeypatch.setattr(parallel, "AXES", (*parallel.AXES, Recording))
    strategy = get_strategy("parallel")
    strategy.recorded = calls = []
    strategy.setup_environment(_env(0, 1), comm=SimWorld(1, device=CPU).comm(0))
    assert [type(a) for a in strategy.axes][-1] is Recording
    module = nn.Linear(3, 2)
    strategy.setup(module, torch.optim.SGD(module.parameters(), lr=0.1), Precision.from_name("32"))
    assert calls == ["transform", "local_module", "bind ['bias', 'weight']", "opened"]
    calls.clear()
    x = strategy.local_batch(torch.ones(4, 3))
    assert torch.equal(x, torch.full((4, 3), 2.0))
    strategy.backward(module(x).sum())
    strategy.reduce_gradients(1.0)
    strategy.grad_norm()
    strategy.state_layout()
    strategy.full_parameters()
    assert calls == ["local_batch", "reduce_gradients", "counted_elsewhere", "combine_norm", "state", "whole"]
    assert strategy.describe().endswith(", recorded")
    assert strategy.comms_by_axis()["fake"] == [strategy.mesh.comm("tp")]


def test_the_axes_apply_in_a_fixed_order():
    assert [kind.name for kind in parallel.AXES] == ["tp", "ep", "cp", "pp"]


def test_a_moe_layer_dispatches_across_its_group_outside_any_strategy_context():
    """The ep axis installs where a MoE layer's experts are on the layer itself: its forward (and backward) need no
    context entered around them, and compute what the whole layer computes on one process."""
    torch.manual_seed(0)
    whole = MoE(8, 16, experts=4, top_k=2)
    layers = [MoE(8, 16, experts=4, top_k=2) for _ in range(2)]
    for layer in layers:
        layer.load_state_dict(whole.state_dict())
    inputs = [torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    world = SimWorld(2, device=CPU)

    def rank(r: int) -> torch.Tensor:
        strategy = get_strategy("parallel", ep=2, data_parallel="ddp")
        strategy.setup_environment(_env(r, 2), comm=world.comm(r))
        strategy.setup(layers[r], None, Precision.from_name("32"))
        assert layers[r].local_experts == 2
        out = layers[r](inputs[r])  # no forward_context
        out.sum().backward()
        return out.detach()

    for r, out in enumerate(world.run(rank)):
        torch.testing.assert_close(out, whole(inputs[r]).detach(), rtol=1e-5, atol=1e-6)


def test_auxiliary_losses_reach_the_collector_of_their_own_module():
    """A module's collector is installed on it: a layer of another module, run inside, adds nothing to it (ranks
    simulated as threads each build their own module, and count apart)."""
    mine, other = MoE(8, 16, experts=4), MoE(8, 16, experts=4)
    x = torch.randn(2, 5, 8)
    with collecting(mine) as found:
        other(x)
        assert found == []
        mine(x)
    assert len(found) == 1 and found[0][1] == 10
    mine(x)  # outside the step's collection: nothing kept
    assert len(found) == 1
