"""Routing: which experts each token goes to and with what weight, which assignments fit their expert's capacity, and
the auxiliary losses that keep the router balanced.

- ``route``: softmax over the experts then the top k (Mixtral, Switch, GShard), or sigmoid scores then the top k
  (DeepSeek-V3); the k weights normalised to sum to one unless asked otherwise.
- ``within_capacity``: each expert takes at most ``capacity`` assignments; first choices before second ones, tokens
  in order (GShard's priority); the rest are dropped (the token keeps its other experts and its residual).
- ``balance_loss``: Switch/GShard's ``E * sum_e f_e P_e`` (``f_e``: the fraction of the k assignments that chose
  expert e; ``P_e``: the mean probability the router gave it), per sequence as DeepSeek-V3's sequence-wise loss
  (so it is the same on any layout: a sequence's counts are summed over the ranks holding its parts) or over all the
  tokens of the forward ("batch"). 1 when balanced, E when every token picks the same experts.
- ``z_loss``: ST-MoE's router z-loss, the mean squared log-sum-exp of the logits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainkit_strategies.communication.comm import Comm

SCORINGS = ("softmax", "sigmoid")
BALANCES = ("sequence", "batch")


def route(logits: Tensor, k: int, scoring: str = "softmax", normalize: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """``logits`` [tokens, experts] -> the router's probabilities [tokens, experts] (sigmoid scores divided by their
    sum), the weights [tokens, k] and the experts [tokens, k] of each token's top k."""
    if scoring == "softmax":
        probs = logits.softmax(-1)
        top, experts = probs.topk(k, -1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
        top, experts = scores.topk(k, -1)
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        raise ValueError(f"MoE scoring must be one of {SCORINGS}; got {scoring!r}.")
    weights = top / top.sum(-1, keepdim=True) if normalize else top
    return probs, weights, experts


def count_experts(experts: Tensor, num_experts: int) -> Tensor:
    """How many of ``experts`` (a flat tensor of expert indices) name each expert (bincount that also runs on meta
    tensors)."""
    return torch.zeros(num_experts, dtype=torch.long, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))


def capacity_of(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert takes: ``factor`` times its share of the ``tokens x k`` (GShard, Switch)."""
    return math.ceil(factor * tokens * k / num_experts)


def within_capacity(experts: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[tokens, k] booleans: the assignments each expert takes, first choices before second ones and tokens in
    order, up to ``capacity`` each."""
    tokens, k = experts.shape
    flat = experts.t().reshape(-1)  # choice-major: every token's first choice, then every second one
    order = torch.argsort(flat, stable=True)
    counts = count_experts(flat, num_experts)
    starts = counts.cumsum(0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (position < capacity).view(k, tokens).t()


def balance_loss(probs: Tensor, experts: Tensor, sequences: int, mode: str = "sequence",
                 group: Comm | None = None, slices: int = 1) -> Tensor:
    """``E * sum_e f_e P_e`` averaged over ``sequences`` (rows of the batch, tokens sequence-major) or over all the
    tokens ("batch"). ``group``: the ranks holding the other parts of these sequences (their counts are summed; the
    probabilities stay this rank's, whose mean the step combines as it combines the loss); ``slices``: ranks whose
    gradients are summed into one sequence's (each counts its slice's share)."""
    if mode not in BALANCES:
        raise ValueError(f"MoE balance must be one of {BALANCES}; got {mode!r}.")
    tokens, num_experts = probs.shape
    k = experts.shape[1]
    rows = sequences if mode == "sequence" else 1
    per_row = tokens // rows
    counts = torch.zeros(rows, num_experts, device=probs.device, dtype=torch.float32)
    counts.scatter_add_(1, experts.reshape(rows, per_row * k), torch.ones(rows, per_row * k, device=probs.device))
    parts = 1
    if group is not None and group.active:
        group.all_reduce(counts)
        parts = group.world_size
    fraction = counts / (k * per_row * parts)
    mean_prob = probs.float().view(rows, per_row, num_experts).mean(1)
    return num_experts * (fraction * mean_prob).sum(-1).mean() / slices


def z_loss(logits: Tensor, slices: int = 1) -> Tensor:
    return torch.logsumexp(logits.float(), -1).square().mean() / slices
