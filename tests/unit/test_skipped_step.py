"""The step after an fp16 overflow skip is a whole, ordinary step under every strategy.

Under ``"16-mixed"`` a window whose gradients overflow is skipped on every rank; the sharded strategies keep the
window's factor (normalisation, loss-scale undo) aside until gradients reach the masters, so a skip that left it
behind would shrink the next step's gradients and norm by that factor. Each strategy at 2 ranks (threads of this
process, real values) trains three windows of two micro-batches with the second window's first micro-batch
poisoned (an infinite loss), and every parameter after each window is held to a hand-written fp32 loop that skips
that window: equal within fp16 rounding, where a leftover factor (1/16 here, the loss scale 8 times the
normalisation 1/2) would be far off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.simworld import CPU, SimWorld
from trainkit.dispatch import HookDispatch
from trainkit.step import OptimizerStep, StepConfig
from trainkit_strategies import DynamicLossScaler, Environment, Precision, get_strategy

STRATEGIES = [("ddp", {}), ("zero1", {"bucket_mb": 1e-4}), ("zero2", {"bucket_mb": 1e-4}),
              ("zero_offload", {"bucket_mb": 1e-4}), ("zero3", {"persistence_threshold": 0}), ("fsdp", {}),
              ("pipeline", {"stages": 2, "microbatches": 2}), ("pipeline", {"stages": 1, "data_parallel": "zero2"})]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.poison = False

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = (out.float() - y).pow(2).mean()
        return loss * float("inf") if self.poison else loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(self.net(batch[0]), batch[1])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return self._loss(output, batch[1])


def windows() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(2)]
            for _ in range(3)]


def hand_loop(optimizer: type = torch.optim.SGD, lr: float = 0.5) -> list[dict[str, torch.Tensor]]:
    """fp32 ``optimizer`` on each whole window, the poisoned one skipped."""
    net = Net()
    opt = optimizer(net.parameters(), lr=lr)
    out = []
    for w, window in enumerate(windows()):
        if w != 1:
            opt.zero_grad()
            x, y = (torch.cat(parts) for parts in zip(*window, strict=True))
            net.training_step((x, y), 0).backward()
            opt.step()
        out.append({f"net.{k}": v.detach().clone() for k, v in net.net.named_parameters()})
    return out


@pytest.mark.parametrize(("name", "options", "optimizer", "lr"),
                         [(n, o, torch.optim.SGD, 0.5) for n, o in STRATEGIES]
                         + [("zero_offload", {"bucket_mb": 1e-4}, torch.optim.AdamW, 0.01)],  # the host Adam kernel
                         ids=[f"{n}-{o}" for n, o in STRATEGIES] + ["zero_offload-adamw"])
def test_the_step_after_an_overflow_skip_is_whole(name, options, optimizer, lr):
    world = SimWorld(2, device=CPU)
    nets = [Net() for _ in range(2)]
    data = windows()

    def rank(r: int) -> tuple[list[dict[str, torch.Tensor]], list[bool]]:
        strategy = get_strategy(name, **options)
        strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
        net = nets[r]
        policy = Precision.from_name("16-mixed", DynamicLossScaler(init_scale=8.0))
        strategy.setup(net, optimizer(net.parameters(), lr=lr), policy)
        step = OptimizerStep(strategy, StepConfig(2), policy, HookDispatch(None, net))
        params, stepped = [], []
        for w, window in enumerate(data):
            for m, (x, y) in enumerate(window):
                net.poison = w == 1 and m == 0
                replica, replicas = strategy.dp_rank, strategy.dp_size
                step.micro_step(net, (x[replica::replicas], y[replica::replicas]), m, boundary=m == 1)
            stepped.append(step.step())
            params.append({k: v.detach().clone() for k, v in strategy.full_parameters().items()})
        return params, stepped

    params, stepped = world.run(rank)[0]
    assert stepped == [True, False, True]
    for w, (got, want) in enumerate(zip(params, hand_loop(optimizer, lr), strict=True)):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=2e-2, atol=2e-3,
                                       msg=lambda m, k=key, w=w: f"window {w}, {k}: {m}")



REDUCERS = [("zero1", {}), ("zero2", {}), ("zero_offload", {}), ("zero3", {}), ("fsdp", {}),
            ("parallel", {}), ("parallel", {"data_parallel": "zero2"})]  # every engine that reduces in reduce_dtype


@pytest.mark.parametrize(("name", "options"), REDUCERS,
                         ids=[f"{n}-{o['data_parallel']}" if o else n for n, o in REDUCERS])
def test_reduce_dtype_fp32_sums_bf16_gradients_exactly_where_bf16_rounds(name, options):
    """The precision policy's ``reduce_dtype="fp32"`` under bf16-mixed at 4 ranks: the reduced gradient is the exact
    mean of the ranks' bf16 gradients to fp32 rounding, where the default bf16 sum is off by bf16's rounding of its
    partial sums; under every engine that reduces in it (``parallel``: its fsdp engine, and zero2 by name)."""
    from trainkit.demo.gpt import DemoGPT

    world_size, gen = 4, torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 16, (world_size * 4, 17), generator=gen)

    def model() -> DemoGPT:
        torch.manual_seed(0)
        return DemoGPT(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=32)

    def loss_of(net: nn.Module, r: int) -> torch.Tensor:
        x, y = tokens[r::world_size, :-1], tokens[r::world_size, 1:]
        return torch.nn.functional.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())

    exact: dict[str, torch.Tensor] = {}  # the mean, in float64, of each rank's gradient under bf16 weights
    for r in range(world_size):
        net = model().to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_of(net, r).backward()
        for n, p in net.named_parameters():
            exact[n] = exact.get(n, 0) + p.grad.double() / world_size

    def reduced(reduce_dtype: str | None) -> dict[str, torch.Tensor]:
        world = SimWorld(world_size, device=CPU)
        models = [model() for _ in range(world_size)]

        def rank(r: int) -> dict[str, torch.Tensor]:
            strategy = get_strategy(name, **options)
            strategy.setup_environment(Environment(rank=r, world_size=world_size), comm=world.comm(r))
            strategy.setup(models[r], torch.optim.AdamW(models[r].parameters()),
                           Precision.from_name("bf16-mixed", reduce_dtype=reduce_dtype))
            with strategy.forward_context():
                loss = loss_of(models[r], r)
            strategy.backward(loss)
            strategy.reduce_gradients(1.0 / world_size)
            return {n: g.double() for n, g in strategy.full_gradients().items()}

        return world.run(rank)[0]

    def error(got: dict[str, torch.Tensor]) -> float:
        return max(float((got[n] - exact[n]).abs().max() / exact[n].abs().max()) for n in exact)

    in_bf16, in_fp32 = error(reduced(None)), error(reduced("fp32"))
    print(f"{name}: largest relative error of a reduced gradient, bf16 sum {in_bf16:.2e}, fp32 sum {in_fp32:.2e}")
    assert in_fp32 < 1e-6, in_fp32
    assert in_bf16 > 100 * in_fp32 and in_bf16 > 1e-4, (in_bf16, in_fp32)
