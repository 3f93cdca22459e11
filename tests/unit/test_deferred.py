"""Sharded initialisation replays what configure_model computed on the meta device, value for value."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import DeferredInitNet
from trainkit_strategies.init.recorder import InitRecorder, Replayer


def test_replay_gives_one_process_values_and_generator_state():
    torch.manual_seed(0)
    real = DeferredInitNet()
    real.configure_model()
    after_real = torch.get_rng_state()

    torch.manual_seed(0)
    meta = DeferredInitNet()
    recorder = InitRecorder()
    with torch.device("meta"), recorder:
        meta.configure_model()
    assert all(p.is_meta for p in meta.parameters())
    assert torch.equal(torch.get_rng_state(), after_real)  # random draws advanced the generator as for real
    assert torch.nn.init.trunc_normal_ is not None and not hasattr(torch.nn.init.trunc_normal_, "__wrapped__")

    replayer = Replayer(recorder)
    got = dict(meta.named_parameters()) | dict(meta.named_buffers())
    want = dict(real.named_parameters()) | dict(real.named_buffers())
    assert got.keys() == want.keys()
    big = torch.zeros(sum(t.numel() for t in want.values()) + 5)  # targets at offsets inside one buffer
    offset = 5
    for name, tensor in got.items():
        out = big[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
        replayer.fill(tensor, out)
        assert torch.equal(out, want[name].detach()), name
    assert torch.equal(torch.get_rng_state(), after_real)  # replaying leaves the generator where it was


def test_an_init_function_kept_past_its_recording_records_into_the_next():
    """A library that keeps torch's init functions at its import (transformers 5 does) may import inside a first
    recording and keep that recording's wrapper: later recordings still log its calls, so a second model built in
    the same process gets its one-process values too (it used to replay without its initialisation)."""
    kept = {}
    for build in range(2):
        recorder = InitRecorder()
        torch.manual_seed(build)
        with torch.device("meta"), recorder:
            weight = torch.empty(4, 3)
            kept.setdefault("normal_", torch.nn.init.normal_)  # the first recording's, kept
            kept["normal_"](weight, std=0.5)
        torch.manual_seed(build)
        expected = torch.empty(4, 3).normal_(std=0.5)
        out = torch.empty(4, 3)
        Replayer(recorder).fill(weight, out)
        assert torch.equal(out, expected), build


def test_a_deep_copy_made_while_recording_replays_as_a_copy():
    """torchmetrics keeps each state's default and resets the state to a deep copy of it: a copy made on meta is
    rebuilt as a copy of its source (replaying the deep copy itself recursed through its memo without end)."""
    torchmetrics = __import__("pytest").importorskip("torchmetrics")
    recorder = InitRecorder()
    with torch.device("meta"), recorder:
        metric = torchmetrics.MaxMetric()
    replayer = Replayer(recorder)
    for tensor in (metric._defaults["max_value"], metric.max_value):
        out = torch.zeros(())
        replayer.fill(tensor, out)
        assert out.item() == float("-inf")


class _Seeded(torch.nn.Module):
    """configure_model code that reads, sets and draws from the generator for real between its meta draws."""

    def build(self) -> dict[str, torch.Tensor]:
        torch.manual_seed(3)
        self.a = torch.nn.Linear(8, 8)
        torch.manual_seed(3)  # the same state again: b must equal a
        self.b = torch.nn.Linear(8, 8)
        real = torch.randn(5, device="cpu")  # a real draw, after b's
        with torch.random.fork_rng():  # reads the state (after the draws so far), restores it
            torch.randn(7)
        state = torch.get_rng_state().clone()
        self.c = torch.nn.Linear(8, 8)
        return {"real": real, "state": state}


def _build(defer: bool | None) -> tuple[_Seeded, dict[str, torch.Tensor], InitRecorder | None]:
    model = _Seeded()
    if defer is None:
        return model, model.build(), None
    recorder = InitRecorder(defer=defer)
    with torch.device("meta"), recorder:
        seen = model.build()
    return model, seen, recorder


def test_a_recording_sees_the_generator_as_one_process_does():
    """Seeding twice to the same state, a real draw, fork_rng and get_rng_state inside configure_model see what one
    process sees, though the recording's draws are worked out later (deferred): the generator is brought up to date
    whenever it is read, set or drawn from for real."""
    real, want, _ = _build(None)
    after = torch.get_rng_state()
    for defer in (True, False):
        model, seen, recorder = _build(defer)
        assert torch.equal(seen["real"], want["real"]) and torch.equal(seen["state"], want["state"]), defer
        replayer = Replayer(recorder)
        replayer.finish()
        assert torch.equal(torch.get_rng_state(), after), defer
        for name, p in model.named_parameters():
            out = torch.empty(p.shape)
            replayer.fill(p, out)
            assert torch.equal(out, dict(real.named_parameters())[name].detach()), (defer, name)
        assert torch.equal(torch.get_rng_state(), after), defer


class _Draws(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.elements = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.split("::")[1].rstrip("_") in ("normal", "uniform") and args[0].device.type == "cpu":
            self.elements += args[0].numel()
            self.largest = max(self.largest, args[0].numel())
        return out


def test_a_deferred_recording_draws_each_number_once():
    """Modules that draw in reset_parameters and again in the model's own init (as Hugging Face models do): a rank
    that materialises everything draws as many numbers as one process does, not twice as many (once to advance the
    generator while recording, again to replay); the draw a later one overwrites is made on a scratch tensor, for the
    generator's sake only."""
    def build() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
        for layer in model:  # every draw of reset_parameters overwritten, as Hugging Face's _init_weights does
            torch.nn.init.normal_(layer.weight, std=0.02)
            torch.nn.init.zeros_(layer.bias)
        return model

    with _Draws() as eager:
        torch.manual_seed(0)
        want = build()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    with _Draws() as lazy:
        recorder = InitRecorder(defer=True)
        with torch.device("meta"), recorder:
            model = build()
        replayer = Replayer(recorder)
        for (name, p), w in zip(model.named_parameters(), want.parameters(), strict=True):
            out = torch.empty(p.shape)
            replayer.fill(p, out)
            assert torch.equal(out, w.detach()), name
        replayer.finish()
    assert torch.equal(torch.get_rng_state(), after)
    assert lazy.elements == eager.elements > 0, (lazy.elements, eager.elements)


def test_draws_between_the_recording_and_setup_are_named():
    torch.manual_seed(0)
    recorder = InitRecorder(defer=True)
    with torch.device("meta"), recorder:
        torch.nn.Linear(4, 4)
    torch.rand(1)  # the generator has not caught up with the recording's draws yet
    with pytest.warns(UserWarning, match="differ from a one-process run"):
        Replayer(recorder).finish()


def test_a_large_draw_nobody_replays_is_made_in_pieces_with_the_same_numbers_after():
    """A draw nobody replays (a layer's weight a later tie replaces) is made on scratch while the rank holds its share:
    in pieces of PIECE numbers, leaving the generator where the whole draw does."""
    from trainkit_strategies.init import draws

    def build() -> tuple[torch.nn.Module, torch.nn.Module]:
        big = torch.nn.Linear(2 * draws.PIECE // 512 + 3, 512, bias=False)  # more than 2 * PIECE numbers
        torch.nn.init.normal_(tensor=big.weight, std=0.02)  # as transformers calls it, by keyword
        return big, torch.nn.Linear(16, 8)

    torch.manual_seed(0)
    _, want = build()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    recorder = InitRecorder(defer=True)
    with torch.device("meta"), recorder:
        _, small = build()
    replayer = Replayer(recorder)
    with _Draws() as counted:
        for p, w in zip(small.parameters(), want.parameters(), strict=True):
            out = torch.empty(p.shape)
            replayer.fill(p, out)
            assert torch.equal(out, w.detach())
        replayer.finish()
    assert torch.equal(torch.get_rng_state(), after)
    assert counted.largest <= draws.PIECE  # the big weight's kaiming and normal draws, in pieces
