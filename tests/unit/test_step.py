"""The optimizer step component on its own: the single strategy, no Trainer, hand-computed references.

Plain SGD with lr=1 makes each step's update the gradient it applied (``before - after``), so what the
component did to the gradients (normalisation, unscaling, clipping) is read off the parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from trainkit.callbacks import Callback
from trainkit.dispatch import HookDispatch
from trainkit.step import OptimizerStep, StepConfig
from trainkit_strategies import DynamicLossScaler, Environment, Precision, get_strategy


class Net(nn.Module):
    """A linear model whose training_step returns a masked mean and, when asked, its item count."""

    def __init__(self, items: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.items = items

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, mask = batch
        err = (self.lin(x).squeeze(-1) - y).pow(2)
        n = mask.sum()
        loss = (err * mask).sum() / n
        return {"loss": loss, "num_items": n} if self.items else loss


def batches(counts: list[int], size: int = 5) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in counts:
        mask = (torch.arange(size) < n).float()
        out.append((torch.randn(size, 4, generator=gen), torch.randn(size, generator=gen), mask))
    return out


def runner(module: nn.Module, k: int, clip: float | None = None, algorithm: str = "norm",
           scaler: DynamicLossScaler | None = None, precision: str = "32",
           callbacks: tuple[Callback, ...] = ()) -> OptimizerStep:
    strategy = get_strategy("single")
    strategy.setup_environment(Environment())
    policy = Precision.from_name(precision, scaler)
    strategy.setup(module, torch.optim.SGD(module.parameters(), lr=1.0), policy)
    hooks = HookDispatch(None, module, callbacks)
    return OptimizerStep(strategy, StepConfig(k, clip, algorithm), policy, hooks)


def applied_update(module: nn.Module, before: nn.Module) -> torch.Tensor:
    return torch.cat([(b - a).detach().reshape(-1) for a, b in zip(module.parameters(), before.parameters(),
                                                                  strict=True)])


def reference_grad(module: nn.Module, data: list, weights: list[float]) -> torch.Tensor:
    """The gradient of sum_i w_i L_i, by autograd on a copy."""
    ref = copy.deepcopy(module)
    total: Any = 0.0
    for i, (batch, w) in enumerate(zip(data, weights, strict=True)):
        out = ref.training_step(batch, i)
        total = total + w * (out["loss"] if isinstance(out, dict) else out)
    total.backward()
    return torch.cat([p.grad.reshape(-1) for p in ref.parameters()])


def run_window(step: OptimizerStep, module: nn.Module, data: list) -> bool | None:
    for i, batch in enumerate(data):
        step.micro_step(module, batch, i, boundary=i + 1 == len(data))
    return step.step()


def test_num_items_weights_each_micro_batch_by_its_count():
    counts = [1, 4, 2]
    module = Net(items=True)
    before = copy.deepcopy(module)
    step = runner(module, k=3)
    data = batches(counts)
    assert run_window(step, module, data) is True
    want = reference_grad(before, data, [n / sum(counts) for n in counts])
    torch.testing.assert_close(applied_update(module, before), want, rtol=1e-6, atol=1e-7)
    # and it is not the plain mean of the micro-batch means
    wrong = reference_grad(before, data, [1 / 3] * 3)
    assert (applied_update(module, before) - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("items", [False, True], ids=["plain", "num_items"])
def test_a_short_final_window_is_normalised_by_what_it_held(items):
    """k=4, but the data ends after 2 micro-batches: the step is the mean over those 2 (or their items)."""
    counts = [3, 5]
    module = Net(items=items)
    before = copy.deepcopy(module)
    step = runner(module, k=4)
    data = batches(counts)
    assert run_window(step, module, data) is True
    weights = [n / sum(counts) for n in counts] if items else [0.5, 0.5]
    torch.testing.assert_close(applied_update(module, before), reference_grad(before, data, weights),
                               rtol=1e-6, atol=1e-7)


class InfOnce(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 0 and not getattr(self, "poisoned", False) else loss


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale():
    module = InfOnce(items=False)
    scaler = DynamicLossScaler(init_scale=1024.0)
    step = runner(module, k=1, scaler=scaler, precision="16-mixed")
    before = copy.deepcopy(module)
    assert run_window(step, module, batches([5])) is False
    assert torch.equal(applied_update(module, before), torch.zeros(5))
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    assert all(p.grad is None or not p.grad.any() for p in module.parameters())  # zeroed for the next window
    module.poisoned = True
    assert run_window(step, module, batches([5])) is True
    assert applied_update(module, before).abs().max() > 0
    assert torch.isfinite(torch.cat([p.reshape(-1) for p in module.parameters()])).all()


def test_loss_scaling_is_undone_before_the_update():
    """With a scale of 1024 the applied gradient is the unscaled one (autocast's fp16 rounding aside)."""
    module = Net(items=False)
    before = copy.deepcopy(module)
    step = runner(module, k=2, scaler=DynamicLossScaler(init_scale=1024.0), precision="16-mixed")
    data = batches([5, 5])
    assert run_window(step, module, data) is True
    torch.testing.assert_close(applied_update(module, before), reference_grad(before, data, [0.5, 0.5]),
                               rtol=1e-2, atol=1e-3)


class Seen(Callback):
    """Gradients as the step's hook sees them: reduced, normalised and unscaled, before clipping."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.grads.append(torch.cat([p.grad.reshape(-1).clone() for p in module.parameters()]))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_by_norm_and_by_value(algorithm):
    module = Net(items=False)
    before = copy.deepcopy(module)
    seen = Seen()
    step = runner(module, k=2, clip=0.05, algorithm=algorithm, callbacks=(seen,))
    data = batches([5, 5])
    assert run_window(step, module, data) is True
    raw = reference_grad(before, data, [0.5, 0.5])
    torch.testing.assert_close(seen.grads[0], raw, rtol=1e-6, atol=1e-7)  # the hook sees the unclipped gradient
    ref = copy.deepcopy(before)
    for p, g in zip(ref.parameters(), raw.split([p.numel() for p in ref.parameters()]), strict=True):
        p.grad = g.view_as(p).clone()
    if algorithm == "norm":
        assert torch.linalg.vector_norm(raw) > 0.05  # the case clips
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    else:
        assert raw.abs().max() > 0.05
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(applied_update(module, before), want, rtol=1e-6, atol=1e-7)


def test_an_empty_window_takes_no_step():
    module = Net(items=False)
    assert runner(module, k=2).step() is None


def test_the_forward_path_is_chosen_once():
    """A strategy that runs its own schedule gets the scheduled path at construction, not per micro-batch."""
    module = Net(items=False)
    plain = runner(module, k=1)
    assert plain._forward_backward.__func__ is OptimizerStep._training_step
    pipeline = get_strategy("pipeline")
    pipeline.setup_environment(Environment())
    scheduled = OptimizerStep(pipeline, StepConfig(), Precision.from_name("32"), HookDispatch(None))
    assert scheduled._forward_backward.__func__ is OptimizerStep._scheduled
