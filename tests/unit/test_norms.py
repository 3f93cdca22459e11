"""Gradient norms are taken in fp32, so fp16 gradient shards with large norms are not reported as inf."""

from __future__ import annotations

import torch

from trainkit_strategies.base import _local_norm


def test_fp16_norm_above_fp16_range_is_finite():
    grads = [torch.full((10,), 60000.0, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    norm = _local_norm(grads, 2.0, torch.device("cpu"))
    expected = torch.linalg.vector_norm(torch.cat([g.float() for g in grads]))
    assert torch.isfinite(norm) and torch.allclose(norm, expected)
