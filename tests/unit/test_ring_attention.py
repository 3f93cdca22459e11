"""Attention across a context-parallel group against one process's attention over the whole sequence.

Ranks are threads of this process moving real values (``tests/simworld.py``); each holds chunks r and 2c-1-r of the
sequence. Checked: outputs and the gradients of q, k and v (reassembled into the whole sequence's order) equal
``F.scaled_dot_product_attention`` on the whole sequence within 2e-6 in fp32, causal and not, at cp = 2, 3 and 4,
for the ring and the all-gather method, through the CPU's fused kernel and the written-out one; every rank computes
the same attention FLOPs under the causal mask (counted by torch's FlopCounterMode, independently of the code); and
the bytes each method moves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tests.simworld import CPU, SimWorld
from trainkit_strategies.axis import install
from trainkit_strategies.context import ring
from trainkit_strategies.context.ring import CONTEXT, ContextParallel, attention, attention_work, positions

B, H, D, M = 2, 3, 8, 5  # batch, heads, head dim, tokens per chunk (a sequence is 2c chunks)


class Attend(torch.nn.Module):
    """A user's layer: attention and positions, across the group the cp axis installed on it (if any)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attention(q, k, v, is_causal=self.causal), positions(q.shape[-2])


def _whole(c: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, 2 * c * M, D, generator=gen) for _ in range(4)]  # q, k, v, and the output's gradient


def _unshard(parts: list[torch.Tensor], c: int) -> torch.Tensor:
    """Rank-ordered local tensors [.., 2M, D] back into the sequence's order."""
    chunks: list[torch.Tensor | None] = [None] * (2 * c)
    for r, part in enumerate(parts):
        first, second = ring.chunk_order(r, c)
        chunks[first], chunks[second] = part[..., :M, :], part[..., M:, :]
    return torch.cat(chunks, -2)  # type: ignore[arg-type]


def _run(c: int, causal: bool, method: str) -> tuple[list, list, list]:
    q, k, v, dout = _whole(c)
    world = SimWorld(c, device=CPU)

    def rank(r: int) -> tuple:
        local = [ring.shard_sequence(t, r, c, dim=2).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        cp = ContextParallel(world.comm(r), method)
        layer = Attend(causal)
        install(layer, CONTEXT, cp)  # what the cp axis's transform does
        out, pos = layer(*local[:3])
        out.backward(local[3])
        return out.detach(), [t.grad for t in local[:3]], pos, cp.work, dict(cp.comm.stats.bytes)

    results = world.run(rank)
    return [r[0] for r in results], [r[1] for r in results], results


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "written-out"])
@pytest.mark.parametrize("method", ["ring", "all_gather"])
@pytest.mark.parametrize("c", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_across_ranks_is_attention_over_the_whole_sequence(c, causal, method, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(ring, "_fused", lambda q: False)
    q, k, v, dout = _whole(c)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    expected.backward(dout)
    outs, grads, results = _run(c, causal, method)
    torch.testing.assert_close(_unshard(outs, c), expected.detach(), atol=2e-6, rtol=2e-6)
    for i, name in enumerate("qkv"):
        torch.testing.assert_close(_unshard([g[i] for g in grads], c), whole[i].grad, atol=2e-6, rtol=2e-6,
                                   msg=f"d{name}")
    for r, result in enumerate(results):  # positions are the rank's real token indices
        first, second = ring.chunk_order(r, c)
        assert result[2].tolist() == [*range(first * M, (first + 1) * M), *range(second * M, (second + 1) * M)]


@pytest.mark.parametrize("c", [2, 4])
def test_causal_work_is_the_same_on_every_rank(c, monkeypatch):
    """FLOPs of each rank's attention forward, as torch's FlopCounterMode counts the kernels it runs (the
    written-out path, whose matmuls it counts exactly; the diagonal chunk pairs cost a full pair there, the same
    on every rank): equal on every rank, and each rank computes 1/c of what a contiguous split's busiest rank
    would not exceed."""
    q, k, v, _ = _whole(c)
    world = SimWorld(c, device=CPU)

    def rank(r: int) -> float:
        local = [ring.shard_sequence(t, r, c, dim=2) for t in (q, k, v)]
        with FlopCounterMode(display=False) as counter:  # inside the operator: its kernels, as they run
            ring._ring_forward(*local, ContextParallel(world.comm(r)), True, D ** -0.5)
        return counter.get_total_flops()

    monkeypatch.setattr(ring, "_fused", lambda q: False)
    flops = world.run(rank)
    assert min(flops) > 0
    assert max(flops) <= 1.05 * min(flops), flops
    assert max(flops) == min(flops)
    # the code's own count of chunk pairs agrees: 2c per rank, half a pair for each of its two diagonal chunks
    assert {attention_work(r, c) for r in range(c)} == {2.0 * c}
    contiguous = [sum(1.0 if j < i else 0.5 if j == i else 0.0 for i in (2 * r, 2 * r + 1) for j in range(2 * c))
                  for r in range(c)]
    assert max(contiguous) > 1.5 * min(contiguous)  # what the load balancing avoids


@pytest.mark.parametrize("c", [2, 4])
def test_bytes_moved(c):
    """Every byte moves as point-to-point hops around the ring (Comm.stats counts a hop's send). Ring: c-1 hops of the
    rank's k and v forward; backward c-1 hops of k, v and their fp32 gradient, and one more of the gradient home.
    All-gather: k and v gathered in forward and again in backward (c-1 hops each), the gradients reduce-scattered
    (c-1 hops of one rank's share)."""
    kv = 2 * B * H * 2 * M * D * 4  # this rank's k and v, fp32
    ring_bytes = _run(c, True, "ring")[2][0][4]
    assert ring_bytes == {"send": (c - 1) * kv + (c - 1) * (kv + kv) + kv}
    gather_bytes = _run(c, True, "all_gather")[2][0][4]
    assert gather_bytes == {"send": 3 * (c - 1) * kv}
