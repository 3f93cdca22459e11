"""Sharded initialisation replays what configure_model computed on the meta device, value for value."""

from __future__ import annotations

import torch

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
