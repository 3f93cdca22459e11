"""ZeRO-Offload's host side: the chunked fused Adam equals torch's, an offloaded step moves and copies per
bucket (not per parameter), and the delayed parameter update applies each step one step late."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies import master as master_module
from trainkit_strategies.host_adam import ChunkedAdam
from trainkit_strategies.zero import OffloadedGradients


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_chunked_adam_equals_torch_fused_adam(cls, amsgrad):
    torch.manual_seed(0)
    n = 10_007  # not a multiple of the chunk
    mine = torch.randn(n)
    ref = mine.clone()
    opt = cls([mine], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, betas=(0.8, 0.95), eps=1e-6)
    torch_opt = cls([ref], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, betas=(0.8, 0.95), eps=1e-6, fused=True)
    chunked = ChunkedAdam(opt, chunk=1000)
    out = torch.empty(n, dtype=torch.bfloat16)
    for _ in range(4):
        grad = torch.randn(n).bfloat16()
        ref.grad = grad.float() * 0.25
        torch_opt.step()
        chunked.step(opt.param_groups[0], mine, grad, out, mult=0.25)
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)  # the kernel divides by 1/mult: rounding only
        assert torch.equal(out, mine.bfloat16())  # the compute-dtype copy is the updated master's
    assert opt.state[mine].keys() == torch_opt.state[ref].keys() and float(opt.state[mine]["step"]) == 4.0


def _offloaded(model: nn.Module, precision: str = "bf16-mixed", **options: Any):
    strategy = get_strategy("zero_offload", bucket_mb=0.02, **options)
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Precision.from_name(precision))
    return strategy


def _train_step(strategy, model: nn.Module, x: torch.Tensor) -> None:
    with strategy.forward_context():
        loss = model(x).float().pow(2).mean()
    strategy.backward(loss)
    strategy.reduce_gradients(1.0)
    strategy.optimizer_step()
    strategy.zero_grad()


def test_zero_offload_runs_the_offloaded_layout_and_the_chunked_step():
    strategy = _offloaded(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    assert isinstance(strategy.grads, OffloadedGradients)
    assert isinstance(strategy._master._chunked, ChunkedAdam)
    assert all(g.device.type == "cpu" for g in strategy.grads.buffers)


class CopyCount(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") in ("copy_", "to", "_to_copy"):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_an_offloaded_step_copies_per_bucket_not_per_parameter():
    """48 parameter tensors in a handful of buckets: the reduction, host step and return of parameters copy
    O(buckets + chunks) times, far fewer than once per parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)])
    strategy = _offloaded(model)
    params, buckets = sum(1 for _ in model.parameters()), len(strategy.buckets)
    assert params == 48 and 2 <= buckets <= 6
    x = torch.randn(4, 16)
    _train_step(strategy, model, x)  # the first step creates the optimizer state
    with strategy.forward_context():
        loss = model(x).float().pow(2).mean()
    strategy.backward(loss)
    counter = CopyCount()
    with counter:
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
    # per bucket: the gradient chunk's conversion and the updated chunk's compute-dtype copy
    assert counter.copies <= 2 * buckets + 4, counter.copies
    assert counter.copies < params


@pytest.mark.cuda
def test_host_device_transfers_are_two_per_bucket_without_conversion(monkeypatch):
    """On a GPU: one gradient copy down and one parameter copy up per bucket, each in the compute dtype."""
    calls: list[tuple[torch.dtype, str, str]] = []
    real = master_module.transfer

    def counted(dst, src):
        calls.append((src.dtype, src.device.type, dst.device.type))
        return real(dst, src)

    monkeypatch.setattr(master_module, "transfer", counted)
    monkeypatch.setattr("trainkit_strategies.zero.transfer", counted)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)]).cuda()
    strategy = get_strategy("zero_offload", bucket_mb=0.02)
    strategy.setup_environment(Environment(device=torch.device("cuda", 0)))
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Precision.from_name("bf16-mixed"))
    calls.clear()
    _train_step(strategy, model, torch.randn(4, 16, device="cuda"))
    buckets = len(strategy.buckets)
    down, up = (torch.bfloat16, "cuda", "cpu"), (torch.bfloat16, "cpu", "cuda")
    assert sorted(calls) == sorted([down] * buckets + [up] * buckets)


def test_delayed_update_applies_each_step_one_step_late():
    """With DPU, step t's forward sees the parameters after step t-2: after k steps the parameters are those a
    synchronous run reaches after k-1 steps fed the same (delayed) gradients, and reading state settles it."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    xs = [torch.randn(4, 8) for _ in range(5)]
    delayed_model = copy.deepcopy(template)
    delayed = _offloaded(delayed_model, precision="32", delayed_update=True)
    seen = []
    for x in xs:
        seen.append(copy.deepcopy(delayed_model.state_dict()))
        _train_step(delayed, delayed_model, x)
    # reference: a hand loop where the gradient of step t is taken at the parameters of step t-2
    ref = copy.deepcopy(template)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    visible = copy.deepcopy(template)
    for t, x in enumerate(xs):
        for k, v in visible.state_dict().items():  # fused vs foreach Adam: rounding apart, a step is ~1e-2 apart
            torch.testing.assert_close(seen[t][k], v, rtol=0, atol=1e-6, msg=lambda m, k=k, t=t: f"step {t} {k}: {m}")
        visible.zero_grad()
        visible(x).float().pow(2).mean().backward()
        for p, q in zip(ref.parameters(), visible.parameters(), strict=True):
            p.grad = q.grad.clone()
        visible.load_state_dict(ref.state_dict())  # what the device sees next: the update of the step before
        opt.step()
    final = delayed.full_parameters()  # settles the last step
    for name, p in ref.named_parameters():
        torch.testing.assert_close(final[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)
