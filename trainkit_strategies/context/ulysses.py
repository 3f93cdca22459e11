"""Ulysses attention (DeepSpeed-Ulysses; Jacobs et al., 2023): the context-parallel group trades its slices of the
sequence for slices of the heads and back, by two all-to-alls per attention.

Each rank holds its two chunks of every sequence (``ring.py``'s layout) for all heads. Before attention, one
all-to-all gives each rank the whole sequence for ``heads / cp`` of the heads (its share of every rank's chunks,
put back in sequence order); attention then runs locally over the whole sequence (``F.scaled_dot_product_attention``,
causal as asked); after it, a second all-to-all gives every rank its own chunks again, for all heads. Backward runs
the same exchanges the other way. The all-to-alls run on the communicator ring attention rides on (the sharding
engine's, over ``dp_shard x cp``), each rank sending nothing to the ranks outside its cp group, so no two
communicators have kernels in flight that could wait on each other (NCCL's rule).

Bytes a rank sends per attention, in units of its own queries (``cp - 1`` of ``cp`` parts of each tensor leave it):
Ulysses sends ``(cp - 1)/cp`` of q, k, v and the output forward and of their gradients backward, ``8 (cp - 1)/cp``;
the ring sends k and v ``cp - 1`` times forward, and backward k and v again with their (fp32) gradients, which come
home after ``cp`` hops: ``2(cp - 1) + 2(cp - 1) + 2cp``. At cp = 2 Ulysses sends half the ring's, and the gap grows
with cp; all of it in collectives rather than hops. The limit: the heads (after grouped key/value heads are repeated
to the query heads) must divide by ``cp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import ConfigurationError


def _natural(size: int) -> list[tuple[int, int]]:
    """For each chunk of the sequence in order, (the rank holding it, its place among that rank's two)."""
    return [(c, 0) if c < size else (2 * size - 1 - c, 1) for c in range(2 * size)]


def _exchange(comm: Comm, members: list[int], send: Tensor, received: Tensor) -> None:
    """Block ``i`` of ``send`` (dimension 0, one per member) to member ``i``; ``received``'s block ``i`` from it. Ranks
    of ``comm`` outside ``members`` get (and send) nothing."""
    if comm.world_size == len(members):
        comm.all_to_all(received.view(-1), send.view(-1))
        return
    block = send[0].numel()
    sizes = [block if j in members else 0 for j in range(comm.world_size)]
    comm.all_to_all(received.view(-1), send.view(-1), output_splits=sizes, input_splits=sizes)


def heads_from_sequence(x: Tensor, comm: Comm, members: list[int]) -> Tensor:
    """``[b, h, n, d]`` (this rank's chunks, all heads) -> ``[b, h / cp, cp * n, d]`` (its heads, the whole sequence
    in order); ``members``: the ranks of ``comm`` in the cp group, in cp order."""
    size = len(members)
    b, h, n, d = x.shape
    send = x.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()  # [to member, b, h/cp, n, d]
    received = torch.empty_like(send)  # [from member, b, h/cp, n, d]: each member's two chunks of my heads
    _exchange(comm, members, send, received)
    halves = received.view(size, b, h // size, 2, n // 2, d)
    return torch.cat([halves[rank, :, :, part] for rank, part in _natural(size)], dim=2)


def sequence_from_heads(y: Tensor, comm: Comm, members: list[int]) -> Tensor:
    """The inverse: ``[b, h / cp, cp * n, d]`` -> ``[b, h, n, d]``."""
    size = len(members)
    b, hh, total, d = y.shape
    chunks = y.view(b, hh, 2 * size, total // (2 * size), d)
    send = torch.empty(size, b, hh, 2, total // (2 * size), d, dtype=y.dtype, device=y.device)
    for c, (rank, part) in enumerate(_natural(size)):
        send[rank, :, :, part] = chunks[:, :, c]
    received = torch.empty_like(send)  # [from member (its heads), b, h/cp, 2, n/2, d]
    _exchange(comm, members, send, received)
    return received.view(size, b, hh, total // size, d).transpose(0, 1).reshape(b, size * hh, total // size, d)


class _ToHeads(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm, members: list[int]) -> Tensor:
        ctx.comm, ctx.members = comm, members
        return heads_from_sequence(x, comm, members)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return sequence_from_heads(grad.contiguous(), ctx.comm, ctx.members), None, None


class _ToSequence(Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, comm: Comm, members: list[int]) -> Tensor:
        ctx.comm, ctx.members = comm, members
        return sequence_from_heads(y.contiguous(), comm, members)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return heads_from_sequence(grad.contiguous(), ctx.comm, ctx.members), None, None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, comm: Comm, members: list[int], causal: bool,
                      scale: float | None) -> Tensor:
    """Attention of this rank's chunks (``[b, h, n, d]``, heads divisible by the group) over the whole sequence;
    ``members``: the cp group's ranks of ``comm``, in cp order."""
    heads, size = q.shape[1], len(members)
    if heads % size:
        raise ConfigurationError(f"cp_method='ulysses' gives each of the cp={size} ranks heads/cp of the heads, "
                         f"but attention has {heads}: use a cp that divides {heads}, or cp_method='ring'.")
    q, k, v = (_ToHeads.apply(t.contiguous(), comm, members) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return _ToSequence.apply(out, comm, members)
