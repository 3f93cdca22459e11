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
