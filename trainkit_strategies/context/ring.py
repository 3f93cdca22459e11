"""Attention over a sequence split across the ranks of a context-parallel group.

Layout (causal load balancing, as in Megatron-LM's and torchtitan's context parallelism): a sequence of ``s``
tokens is cut into ``2c`` chunks of ``s / 2c``; rank ``r`` of ``c`` holds chunks ``r`` and ``2c - 1 - r``, in that
order. Under a causal mask, query chunk ``i`` sees key chunks ``j < i`` whole, ``j = i`` up to the diagonal and
``j > i`` not at all, so every rank computes ``2c`` chunk pairs' worth of scores (``attention_work``), where cutting
the sequence in ``c`` contiguous pieces would give the last rank ``2c - 1`` times the first's.

``attention(q, k, v, is_causal)`` is what a model calls (``trainkit.parallel.attention``); outside a
context-parallel region it is ``F.scaled_dot_product_attention``. Inside one it runs:

- ``"ring"`` (Liu et al., 2023, "Ring Attention with Blockwise Transformers"): the key/value block of each rank
  travels around the group, one hop per step, sent while the block in hand is being used; each step's partial
  result is merged exactly with the running one through their log-sum-exps. Backward is a ring too: the key/value
  block travels with the gradient accumulated for it, and after ``c`` hops the gradient arrives home. A rank holds
  one remote block at a time.
- ``"all_gather"`` (Llama 3's choice; Dubey et al., 2024, §3.3.2): keys and values are all-gathered (the whole
  sequence's, once per layer, before any is used), queries attend to them locally, and the key/value gradients are
  reduce-scattered. The same bytes as the ring; no overlap, and the whole sequence's keys and values held at once.

All traffic is point-to-point hops around the context-parallel ranks (``ContextParallel.shift``), on the
communicator the strategy gives (the sharding engine's, over ``dp_shard x cp``), so it never runs beside another
communicator's kernels (NCCL's rule).

Each block pair runs through the CPU's fused flash-attention kernel when the tensors are on the CPU (it returns
the log-sum-exp and takes it back in backward) and through an exact written-out fp32 attention elsewhere. Positions:
``positions(n)`` gives the rank's real token indices, so learned and rotary position embeddings follow them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from trainkit_strategies.axis import installed
from trainkit_strategies.communication.comm import Comm, Handle
from trainkit_strategies.context.ulysses import ulysses_attention
from trainkit_strategies.errors import ConfigurationError

METHODS = ("ring", "all_gather", "ulysses")


@dataclass
class ContextParallel:
    """The context-parallel group a forward runs in and how keys and values travel.

    ``comm`` carries the traffic; ``ring`` lists the group ranks of ``comm`` that hold the chunks of one sequence,
    in context-parallel order (default: all of them). Everything moves by point-to-point hops around that ring, so
    the carrier can be the communicator the sharding engine uses over ``dp_shard x cp``: on NCCL no two
    communicators then have kernels in flight that could wait on each other.
    """

    comm: Comm
    method: str = "ring"
    ring: list[int] | None = None
    work: float = 0.0  # chunk pairs of attention scores computed (full pairs 1, diagonal ones 1/2), forward

    @property
    def members(self) -> list[int]:
        return list(range(self.comm.world_size)) if self.ring is None else self.ring

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.members.index(self.comm.rank)

    def shift(self, send: Tensor, recv: Tensor) -> Handle:
        """Send to the next rank of the ring, receive from the previous one (asynchronously)."""
        return self.comm.shift(send, recv, self.ring)

    def gather(self, mine: Tensor) -> list[Tensor]:
        """Every rank's ``mine``, in context-parallel order (``size - 1`` hops around the ring)."""
        blocks: list[Tensor] = [mine] * self.size
        held = mine
        for step in range(self.size - 1):
            incoming = torch.empty_like(mine)
            self.shift(held, incoming).wait()
            held = blocks[(self.rank - step - 1) % self.size] = incoming
        return blocks

    def reduce_scatter(self, parts: Tensor) -> Tensor:
        """``parts`` [size, n]: this rank's contribution to every rank's sum; returns the sum of its own part
        (``size - 1`` hops, each rank adding its contribution as a partial sum passes). ``parts`` is scratch."""
        size, rank = self.size, self.rank
        incoming = torch.empty_like(parts[0])
        for step in range(size - 1):
            self.shift(parts[(rank - step - 1) % size], incoming).wait()
            parts[(rank - step - 2) % size] += incoming
        return parts[rank]

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the model (``copy.deepcopy``) runs on its own: a communicator holds a process group, which
        cannot be copied."""
        return None


CONTEXT = "context_parallel"  # the attribute the ``cp`` axis installs it as on every module of the model


def current() -> ContextParallel | None:
    """The context-parallel group of the module whose forward calls this (``axis.installed``), or None."""
    return installed(CONTEXT)


def chunk_order(rank: int, size: int) -> tuple[int, int]:
    """The two global chunks (of ``2 x size``) ``rank`` holds, in its local order."""
    return rank, 2 * size - 1 - rank


def positions(n: int, device: torch.device | str | None = None) -> Tensor:
    """The global token positions of the ``n`` tokens this rank holds (``arange(n)`` outside context parallelism)."""
    cp = current()
    if cp is None:
        return torch.arange(n, device=device)
    if n % 2:
        raise ValueError(f"A rank's slice of the sequence has {n} tokens; under context parallelism it is two "
                         "equal chunks: the sequence length must divide by 2 x cp.")
    m = n // 2
    return torch.cat([torch.arange(c * m, (c + 1) * m, device=device) for c in chunk_order(cp.rank, cp.size)])


def shard_sequence(t: Tensor, rank: int, size: int, dim: int = 1) -> Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (a contiguous copy)."""
    s = t.shape[dim]
    if s % (2 * size):
        raise ValueError(f"Context parallelism over {size} ranks cuts each sequence into {2 * size} equal chunks, "
                         f"but the sequence has {s} tokens along dimension {dim}: use a length that divides by "
                         f"{2 * size}, or another cp.")
    chunks = t.chunk(2 * size, dim)
    return torch.cat([chunks[c] for c in chunk_order(rank, size)], dim)


def attention_work(rank: int, size: int, causal: bool = True) -> float:
    """Chunk pairs of scores ``rank`` computes (a full pair 1, a diagonal one 1/2): equal on every rank."""
    mine = chunk_order(rank, size)
    if not causal:
        return 2.0 * 2 * size
    return sum(1.0 if j < i else 0.5 if j == i else 0.0 for i in mine for j in range(2 * size))


# -- one block pair ---------------------------------------------------------------------------------------------
def _fused(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one key/value block and its log-sum-exp (fp32, ``[b, h, n]``)."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of the gradients, given the merged output and log-sum-exp of the whole row (flash
    attention's backward: P = exp(S - lse), dS = P * (dO V^T - rowsum(dO * O)))."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), df)
    dp = torch.matmul(df, vf.transpose(-1, -2))
    ds = p * (dp - (df * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _upper(scores: Tensor) -> Tensor:
    n, m = scores.shape[-2:]
    return torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)


def _merge(acc: tuple[Tensor, Tensor] | None, part: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Two partial attentions over disjoint keys, combined exactly: softmax weights renormalised by lse."""
    out, lse = part[0].float(), part[1]
    if acc is None:
        return out, lse
    total = torch.logaddexp(acc[1], lse)
    merged = acc[0] * torch.exp(acc[1] - total).unsqueeze(-1) + out * torch.exp(lse - total).unsqueeze(-1)
    return merged, total


def _pairs(mine: tuple[int, int], theirs: tuple[int, int], causal: bool) -> list[tuple[int, list[int], bool]]:
    """For each local query chunk (0 or 1): the key chunks (0, 1 of the block in hand) it attends to and whether
    that one pair is diagonal (causal within it). Full chunks first, as one call."""
    out = []
    for qi, i in enumerate(mine):
        full = [kj for kj, j in enumerate(theirs) if not causal or j < i]
        diag = [kj for kj, j in enumerate(theirs) if causal and j == i]
        if full:
            out.append((qi, full, False))
        if diag:
            out.append((qi, diag, True))
    return out


def _chunks(t: Tensor, which: list[int]) -> Tensor:
    if len(which) == 2:
        return t
    m = t.shape[-2] // 2
    return t[..., which[0] * m : (which[0] + 1) * m, :]


def _attend_block(q: Tensor, k: Tensor, v: Tensor, mine: tuple[int, int], theirs: tuple[int, int], causal: bool,
                  scale: float, acc: list[tuple[Tensor, Tensor] | None], cp: ContextParallel) -> None:
    m = q.shape[-2] // 2
    for qi, kc, diag in _pairs(mine, theirs, causal):
        part = _block_forward(q[..., qi * m : (qi + 1) * m, :], _chunks(k, kc), _chunks(v, kc), diag, scale)
        acc[qi] = _merge(acc[qi], part)
        cp.work += 0.5 if diag else float(len(kc))


def _grad_block(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mine: tuple[int, int],
                theirs: tuple[int, int], causal: bool, scale: float, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    m = q.shape[-2] // 2
    for qi, kc, diag in _pairs(mine, theirs, causal):
        rows = slice(qi * m, (qi + 1) * m)
        gq, gk, gv = _block_backward(dout[..., rows, :], q[..., rows, :], _chunks(k, kc), _chunks(v, kc),
                                     out[..., rows, :], lse[..., rows], diag, scale)
        dq[..., rows, :] += gq
        keys = slice(None) if len(kc) == 2 else slice(kc[0] * m, (kc[0] + 1) * m)
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv


def _token_major(out: Tensor) -> Tensor:
    """``out`` [b, h, n, d] laid out as [b, n, h, d], as the fused kernels write it: the usual
    ``out.transpose(1, 2).reshape(b, n, h * d)`` before the output projection is then a view, so what the
    projection saves for backward is the storage attention saved already, not a copy."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel, causal: bool,
                  scale: float) -> tuple[Tensor, Tensor]:
    size, rank = cp.size, cp.rank
    mine = chunk_order(rank, size)
    acc: list[tuple[Tensor, Tensor] | None] = [None, None]
    block = _pack(k, v)
    for step in range(size):
        owner = (rank - step) % size
        handle: Handle | None = None
        if step < size - 1:
            incoming = torch.empty_like(block)
            handle = cp.shift(block, incoming)  # the next block arrives while this one is used
        kb, vb = _unpack(block, (k, v))
        _attend_block(q, kb, vb, mine, chunk_order(owner, size), causal, scale, acc, cp)
        if handle is not None:
            handle.wait()
            block = incoming
    return _merged(acc, q.dtype)


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cp: ContextParallel,
                   causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    size, rank = cp.size, cp.rank
    mine = chunk_order(rank, size)
    dq = torch.zeros_like(q, dtype=torch.float32)
    block = _pack(k, v)
    grads = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)  # travels with its block
    for step in range(size):
        owner = (rank - step) % size
        handle: Handle | None = None
        if step < size - 1:  # the block moves on while its gradients are computed; they follow it
            incoming = torch.empty_like(block)
            handle = cp.shift(block, incoming)
        kb, vb = _unpack(block, (k, v))
        dk, dv = _unpack(grads, (k, v))
        _grad_block(dout, q, kb, vb, out, lse, mine, chunk_order(owner, size), causal, scale, dq, dk, dv)
        if handle is not None:
            incoming_grads = torch.empty_like(grads)
            following = cp.shift(grads, incoming_grads)
            handle.wait()
            following.wait()
            block, grads = incoming, incoming_grads
        else:  # the gradient of the block held now belongs to the next rank: send it home
            home = torch.empty_like(grads)
            cp.shift(grads, home).wait()
            grads = home
    dk, dv = _unpack(grads, (k, v))
    return dq, dk, dv


def _gather_forward(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor]:
    size, rank = cp.size, cp.rank
    mine = chunk_order(rank, size)
    acc: list[tuple[Tensor, Tensor] | None] = [None, None]
    blocks = [_unpack(piece, (k, v)) for piece in cp.gather(_pack(k, v))]  # every rank's, before any use
    for owner, (kb, vb) in enumerate(blocks):
        _attend_block(q, kb, vb, mine, chunk_order(owner, size), causal, scale, acc, cp)
    return _merged(acc, q.dtype)


def _gather_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cp: ContextParallel,
                     causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    size, rank = cp.size, cp.rank
    mine = chunk_order(rank, size)
    dq = torch.zeros_like(q, dtype=torch.float32)
    grads = torch.zeros(size, k.numel() + v.numel(), dtype=torch.float32, device=k.device)
    for owner, piece in enumerate(cp.gather(_pack(k, v))):  # the gathered keys and values were not kept
        kb, vb = _unpack(piece, (k, v))
        dk, dv = _unpack(grads[owner], (k, v))
        _grad_block(dout, q, kb, vb, out, lse, mine, chunk_order(owner, size), causal, scale, dq, dk, dv)
    dk, dv = _unpack(cp.reduce_scatter(grads), (k, v))
    return dq, dk, dv


def _merged(acc: list[tuple[Tensor, Tensor] | None], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    out = _token_major(torch.cat([a[0] for a in acc if a is not None], -2).to(dtype))
    return out, torch.cat([a[1] for a in acc if a is not None], -1)


# -- the operator --------------------------------------------------------------------------------------------------
# One opaque operator (``trainkit::cp_attention``), so dispatch modes see attention across the group as one op:
# selective activation checkpointing keeps its output (and never replays the ring's communication), and tracing
# with fake tensors uses its fake. The group travels as a key into this table (an operator takes no Python objects).
_GROUPS: dict[int, ContextParallel] = {}


@torch.library.custom_op("trainkit::cp_attention", mutates_args=())
def cp_attention(q: Tensor, k: Tensor, v: Tensor, group: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries over the whole sequence's keys and values; its output (laid out token-major)
    and log-sum-exp."""
    return _forward(q, k, v, group, causal, scale)


def _forward(q: Tensor, k: Tensor, v: Tensor, group: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    cp = _GROUPS[group]
    return (_ring_forward if cp.method == "ring" else _gather_forward)(q, k, v, cp, causal, scale)


@cp_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, group: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if not is_fake(q) and group in _GROUPS:  # meta tensors (``trainkit estimate``'s step): the ring's traffic counted
        return _forward(q, k, v, group, causal, scale)
    return _token_major(torch.empty_like(q)), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, group, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)  # q, k and v as given: views of a fused projection stay views
    ctx.group, ctx.causal, ctx.scale = group, causal, scale


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    cp = _GROUPS[ctx.group]
    backward = _ring_backward if cp.method == "ring" else _gather_backward
    dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, cp, ctx.causal, ctx.scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: float | None = None,
              dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` for ``[batch, heads, tokens, dim]``
    tensors, across the context-parallel group when there is one (the tokens are then this rank's two chunks of the
    sequence). Key/value heads must equal query heads (repeat them first for grouped-query attention)."""
    cp = current()
    if cp is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    if dropout_p:
        raise ConfigurationError(
            "Attention dropout is not supported under context parallelism (cp > 1): set the model's "
            "attention dropout to 0.")
    if k.shape[1] != q.shape[1]:
        raise ConfigurationError(
            f"Under context parallelism attention takes as many key/value heads as query heads "
            f"({k.shape[1]} vs {q.shape[1]}): repeat them first (repeat_interleave on the head dim).")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cp.method == "ulysses":  # heads for sequence and back, by all-to-all (context/ulysses.py)
        return ulysses_attention(q, k, v, cp.comm, cp.members, is_causal, scale)
    _GROUPS[id(cp)] = cp
    return cp_attention(q, k, v, id(cp), is_causal, scale)[0]
