"""Compressed communication without a process group: 1-bit Adam against AdamW, the sign codec, PowerSGD's
orthogonalisation, and error feedback on cases where dropping it biases the result."""

from __future__ import annotations

import copy

import pytest
import torch

from trainkit.optim import OneBitAdam
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.data_parallel.onebit import (
    compress,
    compressed_all_reduce,
    decompress,
    pack_signs,
    unpack_signs,
)
from trainkit_strategies.data_parallel.powersgd import PowerSGD, orthogonalise


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def test_onebit_adam_before_its_freeze_step_is_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    ours = OneBitAdam(_groups(model), lr=1e-2, betas=(0.9, 0.95), freeze_step=50)
    adamw = torch.optim.AdamW(_groups(reference), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(20):
        x = torch.randn(4, 8)
        for net, opt in ((model, ours), (reference, adamw)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours.state_dict()["state"].keys() == adamw.state_dict()["state"].keys()
    assert not ours.reduces_gradients


def test_onebit_adam_freezes_the_variance_after_freeze_step():
    p = torch.nn.Parameter(torch.ones(4))
    opt = OneBitAdam([p], lr=0.1, freeze_step=3)
    for step in range(6):
        p.grad = torch.full((4,), float(step + 1))
        before = opt.state[p]["exp_avg_sq"].clone() if opt.state else None
        opt.step()
        if step >= 3:
            assert opt.reduces_gradients
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], before)
    assert int(opt.state[p]["step"]) == 6


def _frozen_adam_update(p: torch.Tensor, state: dict, lr: float, step: int, freeze: int) -> torch.Tensor:
    """Adam's update with the variance of ``freeze`` steps, written out (one process: momentum is the gradient's)."""
    denom = state["exp_avg_sq"].sqrt() / (1 - 0.999**freeze) ** 0.5 + 1e-8
    return p - lr / (1 - 0.9**step) * state["exp_avg"] / denom


def test_onebit_adam_keeps_the_frozen_denominators_while_the_variance_holds_still():
    p = torch.nn.Parameter(torch.randn(64))
    opt = OneBitAdam([p], lr=0.1, freeze_step=2)
    for step in range(1, 7):
        p.grad = torch.randn(64)
        expected = None
        if step > 2:  # the update from this step's momentum and the frozen variance, computed afresh
            state = {"exp_avg": opt.state[p]["exp_avg"].lerp(p.grad, 0.1), "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
            expected = _frozen_adam_update(p.detach(), state, 0.1, step, 2)
        opt.step()
        if expected is not None:
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
        assert len(opt.cached()) == (1 if step > 2 else 0)  # kept once frozen, never before
    kept = opt.cached()[0]
    opt.state[p]["exp_avg_sq"].mul_(4.0)  # someone changes the variance in place: the cache must not be used
    p.grad = torch.randn(64)
    state = {"exp_avg": opt.state[p]["exp_avg"].lerp(p.grad, 0.1), "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
    expected = _frozen_adam_update(p.detach(), state, 0.1, 7, 2)
    opt.step()
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    assert opt.cached()[0] is not kept
    opt.load_state_dict(opt.state_dict())  # a load drops it
    assert opt.cached() == []


def test_the_memory_report_counts_onebit_adams_cache():
    from trainkit_strategies import Precision, get_strategy

    model = torch.nn.Linear(16, 8)
    opt = OneBitAdam(model.parameters(), lr=0.1, freeze_step=1)
    strategy = get_strategy("single")
    strategy.setup(model, opt, Precision.from_name("32"))
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    numel = sum(p.numel() for p in model.parameters())
    # Adam's state (2 x 4 B per element, a 4 B step per tensor) and the frozen denominators (4 B per element)
    assert strategy.memory_report().device["optimizer"] == 12 * numel + 4 * 2


def test_sign_codec_round_trips_and_keeps_each_chunks_norm():
    x = torch.randn(4 * 64)
    x[:2] = torch.tensor([0.0, -0.0])  # by the sign bit: +0 is +1, -0 is -1
    assert torch.equal(unpack_signs(pack_signs(x)), torch.where(torch.signbit(x), -1.0, 1.0))
    assert pack_signs(x).numel() == x.numel() // 8
    scales, signs = compress(x, 4)
    restored = decompress(scales, signs)
    norms = torch.linalg.vector_norm(x.view(4, -1), dim=1)
    torch.testing.assert_close(torch.linalg.vector_norm(restored, dim=1), norms)


def test_sign_codec_in_passes_with_reused_scratch_gives_what_one_pass_gives(monkeypatch):
    """The codec works in passes of ``_PASS`` elements through a ``Workspace``; rows that span several passes
    (and a workspace reused across calls of different sizes) give exactly the signs, scales, errors and sums that
    the whole-tensor arithmetic gives."""
    from trainkit_strategies.data_parallel import onebit

    torch.manual_seed(0)
    x = torch.randn(4 * 96)
    error = torch.randn(4 * 96)
    signs = torch.where(torch.signbit(x), -1.0, 1.0).view(4, -1)
    scales = torch.linalg.vector_norm(x.view(4, -1), dim=1) / 96**0.5
    monkeypatch.setattr(onebit, "_PASS", 16)
    work = onebit.Workspace()
    for _ in range(2):
        got_scales, got_signs = compress(x, 4, error, work)
        torch.testing.assert_close(got_scales, scales, rtol=0, atol=0)
        assert torch.equal(got_signs, pack_signs(x).view(4, -1))
        expected_error = (x.view(4, -1) - scales[:, None] * signs).reshape(-1)
        torch.testing.assert_close(error, expected_error, rtol=0, atol=0)
        total = torch.empty(96)
        onebit._decompress_sum(got_scales, got_signs, total, work)
        torch.testing.assert_close(total, (scales[:, None] * signs).sum(0), rtol=1e-6, atol=1e-7)
        small = torch.empty(32)
        assert torch.equal(unpack_signs(got_signs[0, :4], 1.0, out=small, work=work), signs[0, :32])
    assert max(t.numel() for t in work.tensors()) <= 16  # the scratch never grew past one pass


def _feedback_residual(error_feedback: bool, steps: int = 200) -> float:
    """Send the same vector ``steps`` times through 1-bit compression (one rank: worker and server side both
    compress); how far the mean of what arrived is from what was sent, relative to its norm."""
    torch.manual_seed(0)
    x = torch.randn(256) * torch.linspace(0.01, 3.0, 256)
    worker, server, arrived = torch.zeros(256), torch.zeros(256), torch.zeros(256)
    for _ in range(steps):
        y = x.clone()
        compressed_all_reduce(y, worker, server, Comm(), error_feedback)
        arrived += y
    return float(torch.linalg.vector_norm(arrived / steps - x) / torch.linalg.vector_norm(x))


def test_onebit_error_feedback_removes_the_compression_bias():
    with_feedback, without = _feedback_residual(True), _feedback_residual(False)
    assert with_feedback < 0.03, with_feedback  # the error stays bounded, so its share falls as 1/steps
    assert without > 0.3, without  # sign(x) * rms(x) misses every element's own magnitude, every step


def test_orthogonalise_gives_orthonormal_columns():
    p = torch.randn(32, 4, dtype=torch.float64)
    orthogonalise(p)
    torch.testing.assert_close(p.T @ p, torch.eye(4, dtype=torch.float64))


def _powersgd_residual(error_feedback: bool, steps: int = 200) -> float:
    """A fixed full-rank 16x12 gradient through rank-1 PowerSGD ``steps`` times on one rank."""
    torch.manual_seed(0)
    grad = torch.randn(16, 12)
    compressor = PowerSGD(rank=1, warmup_steps=0, error_feedback=error_feedback)
    compressor.build([[(0, grad.shape)]], torch.device("cpu"))
    arrived = torch.zeros_like(grad)
    for _ in range(steps):
        buffer = grad.clone().view(-1)
        compressor.launch(0, buffer)
        compressor.exchange([buffer], Comm())
        arrived += buffer.view_as(grad)
    return float(torch.linalg.vector_norm(arrived / steps - grad) / torch.linalg.vector_norm(grad))


def test_powersgd_error_feedback_removes_the_low_rank_bias():
    with_feedback, without = _powersgd_residual(True), _powersgd_residual(False)
    assert with_feedback < 0.05, with_feedback
    assert without > 0.5, without  # only the leading direction ever arrives


def test_powersgd_compresses_only_matrices_that_gain():
    compressor = PowerSGD(rank=2, warmup_steps=0)
    shapes = [torch.Size([64, 32]), torch.Size([64]), torch.Size([3, 4]), torch.Size([8, 2, 3, 3])]
    offsets = [0, 2048, 2112, 2124]
    compressor.build([list(zip(offsets, shapes, strict=True))], torch.device("cpu"))
    # 64x32 -> 2*(64+32); the vector and the 3x4 (2*(3+4) >= 12) whole; 8x18 -> 2*(8+18)
    assert compressor.wire_bytes(0) == 4 * (2 * 96 + 64 + 12 + 2 * 26)


@pytest.mark.parametrize("bad", [{"rank": 0}, {"warmup_steps": -1}])
def test_powersgd_rejects_bad_options(bad):
    with pytest.raises(ValueError, match="powersgd"):
        PowerSGD(**bad)


def test_onebit_adam_rejects_bad_options():
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam([torch.nn.Parameter(torch.ones(1))], freeze_step=0)
