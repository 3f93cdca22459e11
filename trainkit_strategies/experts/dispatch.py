"""Tokens to their experts and back: sorted by expert and computed as one grouped matrix product per projection,
locally or, under expert parallelism, sent to the ranks holding their experts by all-to-all.

Dropless: every assignment reaches its expert (the number per expert varies from step to step: the counts cross to
the host, as in Megatron-Core's and torchtitan's dropless dispatch). With ``ep`` ranks each holding E/ep consecutive
experts, a rank sends each of them the rows for its experts (``Comm.all_to_all`` with uneven splits, the counts
known to both ends by an all-gather of every rank's counts first), computes its experts on what it received, and
sends the results back the same way; backward runs the two all-to-alls the other way. On the meta device and in fake
tensors (``trainkit estimate``) the counts are unknown: routing is planned as balanced, and the experts loop (the
shapes and bytes are the same; grouped_mm's fake kernel takes CUDA's dtypes only).

What the experts compute is the caller's (``compute``: this rank's experts on their rows, sorted by expert):
trainkit's ``MoE`` has SwiGLU MLPs held as stacked weights ``w1``, ``w3`` [experts, dim, hidden] and ``w2`` [experts,
hidden, dim], ``w2(silu(x w1) * x w3)`` (``experts_forward``); a Hugging Face block keeps its own packed weights and
activation (``huggingface.py``). Both run as ``F.grouped_mm`` where torch has it for the device and dtype
(``by_expert``: the first failure is remembered, with its reason, and the experts loop from then on).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import Function

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.experts.routing import count_experts

_grouped_fails: dict[tuple[str, torch.dtype], str] = {}  # (device type, dtype) -> why grouped_mm failed there
Experts = Callable[[Tensor, list[int]], Tensor]  # rows sorted by expert, counts[e] for local expert e -> outputs


class _AllToAll(Function):
    """Rows to other ranks (uneven splits); its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, comm: Comm, received: list[int], sent: list[int]) -> Tensor:
        ctx.comm, ctx.received, ctx.sent = comm, received, sent
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        comm.all_to_all(out, rows.contiguous(), output_splits=received, input_splits=sent)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        ctx.comm.all_to_all(out, grad.contiguous(), output_splits=ctx.sent, input_splits=ctx.received)
        return out, None, None, None


class _ContiguousGrad(Function):
    """The identity, whose backward hands on a contiguous gradient (grouped_mm's backward takes no other)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def unknown(t: Tensor) -> bool:
    """Whether ``t``'s values are unknown (meta and fake tensors: planning)."""
    return t.is_meta or is_fake(t)


def _balanced(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def grouped_mm_fallback() -> dict[tuple[str, torch.dtype], str]:
    """Where grouped_mm failed and the experts loop instead: (device type, dtype) -> the error."""
    return dict(_grouped_fails)


def gmm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``F.grouped_mm`` of ``x``'s rows (grouped at ``offsets``) by each group's matrix of ``w`` [groups, in, out],
    handing a contiguous gradient back to grouped_mm's backward."""
    return _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offsets))


def by_expert(x: Tensor, counts: list[int], grouped: Callable[[Tensor], Tensor],
              each: Callable[[Tensor, int], Tensor], width: int) -> Tensor:
    """Each expert on its rows of ``x`` (sorted by expert, ``counts[e]`` rows for expert e): ``grouped(offsets)``
    (grouped_mm, the groups ending at ``offsets``) where torch runs it for the device and dtype, else ``each(part,
    e)`` expert by expert; ``width``: the outputs' features."""
    key = (x.device.type, x.dtype)
    if hasattr(F, "grouped_mm") and key not in _grouped_fails and x.shape[0] > 0 and not unknown(x):
        offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
        try:
            return grouped(offsets)
        except (RuntimeError, NotImplementedError) as err:  # a device, dtype or stride grouped_mm does not take
            _grouped_fails[key] = str(err).splitlines()[0]
    outs = [each(part, e) for e, part in enumerate(x.split(counts))]
    return torch.cat(outs) if outs else x.new_zeros((0, width))


def experts_forward(x: Tensor, counts: list[int], w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """SwiGLU of each expert on its rows of ``x`` (sorted by expert, ``counts[e]`` rows for expert e)."""
    return by_expert(x, counts, lambda offs: gmm(F.silu(gmm(x, w1, offs)) * gmm(x, w3, offs), w2, offs),
                     lambda part, e: F.silu(part @ w1[e]) * (part @ w3[e]) @ w2[e], w2.shape[-1])


def dispatch(tokens: Tensor, experts: Tensor, weights: Tensor, keep: Tensor | None, num_experts: int,
             compute: Experts, ep: Comm | None = None) -> tuple[Tensor, Tensor]:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(tokens[t])`` for every token [tokens, dim] (assignments
    outside ``keep`` left out), and the assignments each expert took [num_experts]. ``compute`` runs this rank's
    experts; under ``ep`` it holds experts ``rank * E/ep ...`` and exchanges rows with the group."""
    total, k = experts.shape
    flat = experts.reshape(-1)
    weight = weights.reshape(-1)
    token = torch.arange(total, device=tokens.device).repeat_interleave(k)
    if keep is not None and not unknown(keep):  # (planned as if nothing were dropped)
        kept = keep.reshape(-1)
        flat, weight, token = flat[kept], weight[kept], token[kept]
    order = torch.argsort(flat, stable=True)
    token, weight = token[order], weight[order]
    counts = count_experts(flat, num_experts)
    parallel = ep is not None and ep.active
    if parallel:  # every rank's counts for every expert (both ends of each transfer know its size), in flight
        everyone = counts.new_empty(ep.world_size * num_experts)  # while the rows are gathered
        gathering = ep.all_gather(everyone, counts, async_op=True)
    per_expert = _balanced(int(flat.numel()), num_experts) if unknown(counts) else [int(c) for c in counts.tolist()]
    rows = tokens[token]
    if not parallel:
        out = compute(rows, per_expert)
    else:
        gathering.wait()
        out = _expert_parallel(rows, everyone, per_expert, num_experts, compute, ep)
    combined = torch.zeros_like(tokens).index_add(0, token, out * weight.unsqueeze(-1).to(out.dtype))
    return combined, counts


def _expert_parallel(rows: Tensor, everyone: Tensor, per_expert: list[int], num_experts: int, compute: Experts,
                     ep: Comm) -> Tensor:
    size = ep.world_size
    local = num_experts // size
    table = per_expert * size if unknown(everyone) else [int(c) for c in everyone.tolist()]
    mine = ep.rank * local
    sent = [sum(per_expert[j * local:(j + 1) * local]) for j in range(size)]
    from_each = [table[s * num_experts + mine:s * num_experts + mine + local] for s in range(size)]
    received = [sum(c) for c in from_each]
    arrived = _AllToAll.apply(rows, ep, received, sent)  # by source rank, then by expert
    # each source's rows through the experts as they came (sorted by expert within it): no permutation to undo
    computed = [compute(part, counts_of)
                for part, counts_of in zip(arrived.split(received), from_each, strict=True)]
    return _AllToAll.apply(torch.cat(computed), ep, sent, received)
