"""ZeRO-Offload's host side: the chunked fused Adam equals torch's, an offloaded step moves and copies per
bucket (not per parameter), and the delayed parameter update applies each step one step late."""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies import master as master_module
from trainkit_strategies.data_parallel.zero import OffloadedGradients
from trainkit_strategies.host_adam import ChunkedAdam


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
    monkeypatch.setattr("trainkit_strategies.data_parallel.zero.transfer", counted)
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


def _on_a_gpu_stand_in(world, **options: Any):
    """zero_offload as on a GPU (host memory apart from the device's; ``meta`` stands in for the GPU), 1 rank."""
    from tests.simworld import META, on_device

    strategy = get_strategy("zero_offload", bucket_mb=0.002, **options)
    strategy.setup_environment(Environment(device=META), comm=world.comm(0))
    torch.manual_seed(0)
    model = on_device(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), Precision.from_name("bf16-mixed"))
    return strategy, model


def test_offload_accumulation_never_waits_for_the_bus_inside_backward(monkeypatch):
    """An accumulating micro-step copies each bucket to page-locked staging on the side stream and a host thread adds
    it into the partition once it landed: nothing in backward waits for a copy (the old hook synchronised on every
    bucket's copy), and the window's end waits for all of them."""
    from tests.simworld import META, SimWorld
    from trainkit_strategies.hostcopy import CopyStream

    waits: list[tuple[str, bool]] = []
    pending = lambda self: object()  # a pending copy
    monkeypatch.setattr("trainkit_strategies.data_parallel.zero.CopyStream.mark", pending)
    monkeypatch.setattr(CopyStream, "wait", staticmethod(lambda event: None))  # a wait on the device, not the host
    monkeypatch.setattr(CopyStream, "synchronize", staticmethod(
        lambda event: waits.append((threading.current_thread().name, torch._C._current_graph_task_id() != -1))))
    world = SimWorld(1)

    def run(rank: int) -> None:
        strategy, model = _on_a_gpu_stand_in(world)
        x = torch.randn(4, 32).to(META)
        for micro in range(3):
            with strategy.no_sync() if micro < 2 else contextlib.nullcontext():
                with strategy.forward_context():
                    loss = model(x).float().pow(2).mean()
                strategy.backward(loss)
        inside = [w for w in waits if w[1]]
        assert not inside, f"backward waited for copies: {inside}"
        strategy.reduce_gradients(1.0)  # the window's end: every add and copy has landed
        buckets = len(strategy.buckets)
        assert sum(name.startswith("trainkit-offload-accumulate") for name, _ in waits) == 2 * buckets
        assert len(waits) == 2 * buckets + 2  # and the window's end waited for the last copy of each slot

    world.run(run)


def test_the_delayed_update_waits_for_the_last_upload_before_rewriting_its_buffers(monkeypatch):
    """Under DPU the host step of step t rewrites the page-locked compute-dtype copies that step t-1's parameters
    were uploaded from: it first waits (in its own thread) for those uploads; its spare gradient partition is
    page-locked too (a pageable one makes every other step's copies synchronous)."""
    from tests.simworld import META, SimWorld
    from trainkit_strategies.hostcopy import CopyStream
    from trainkit_strategies.memory import page_locked

    events: list[str] = []
    token = object()
    monkeypatch.setattr("trainkit_strategies.data_parallel.zero.mark", lambda device: token)
    monkeypatch.setattr(CopyStream, "synchronize", staticmethod(
        lambda event: events.append("waited for the upload") if event is token else None))
    world = SimWorld(1)

    def run(rank: int) -> None:
        strategy, model = _on_a_gpu_stand_in(world, delayed_update=True)
        real_step = strategy._master.step
        monkeypatch.setattr(strategy._master, "step", lambda *a, **k: (events.append("host step"), real_step(*a, **k)))
        assert all(b.untyped_storage() in page_locked for b in strategy._spare)
        x = torch.randn(4, 32).to(META)
        for _ in range(2):
            _train_step(strategy, model, x)
        strategy.settle()

    world.run(run)
    # the first step uploads nothing before it; the second one's host step waits for the first one's upload
    assert events == ["host step", "waited for the upload", "host step"]
