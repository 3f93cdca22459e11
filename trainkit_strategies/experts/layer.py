"""``MoE``: a mixture-of-experts MLP (a router, SwiGLU experts held as stacked weights, optional shared experts)
that runs on one process and, unchanged, under expert parallelism (``strategy="parallel"`` with ``ep``)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainkit_strategies.experts.auxiliary import add_auxiliary_loss
from trainkit_strategies.experts.context import ExpertContext
from trainkit_strategies.experts.dispatch import dispatch, experts_forward
from trainkit_strategies.experts.routing import (
    BALANCES,
    SCORINGS,
    balance_loss,
    capacity_of,
    route,
    within_capacity,
    z_loss,
)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Each token's ``top_k`` of ``experts`` SwiGLU MLPs (hidden size ``hidden``), weighted by the router.

    Args:
        scoring: "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3) router scores; ``normalize``: the top k weights
            divided by their sum.
        capacity_factor: None for dropless routing (every assignment reaches its expert); a number for capacity
            routing: each expert takes at most ``ceil(factor * tokens * top_k / experts)`` of a forward's assignments
            (first choices first), the rest dropped and counted (``dropped``).
        balance_coef, z_coef: the load-balancing loss (Switch/GShard) and router z-loss (ST-MoE) coefficients;
            the terms are added to the training objective by the step (``trainkit_strategies.experts.auxiliary``).
        balance: "sequence" (the balance of each sequence, averaged: DeepSeek-V3's sequence-wise loss, the same on
            any layout) or "batch" (of all the tokens of the forward on this rank).
        shared_hidden: hidden size of a shared expert every token goes through (DeepSeek-MoE); 0 for none.

    Tokens are the rows of the input ``[batch, sequence, dim]`` (or ``[tokens, dim]``: one sequence). After each
    training forward ``tokens_per_expert`` [experts] (the assignments each expert took), ``dropped`` (the fraction
    of assignments dropped) and ``balance``/``z`` (the losses' values) describe it (``trainkit.moe.moe_metrics``).
    """

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2, scoring: str = "softmax",
                 normalize: bool = True, capacity_factor: float | None = None, balance_coef: float = 0.01,
                 z_coef: float = 0.0, balance: str = "sequence", shared_hidden: int = 0) -> None:
        super().__init__()
        if scoring not in SCORINGS or balance not in BALANCES:
            raise ValueError(f"MoE scoring must be one of {SCORINGS} and balance one of {BALANCES}; got "
                             f"{scoring!r} and {balance!r}.")
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoE top_k must be between 1 and experts={experts}; got {top_k}.")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoE capacity_factor must be positive (or None: dropless); got {capacity_factor}.")
        self.dim, self.hidden, self.num_experts, self.top_k = dim, hidden, experts, top_k
        self.scoring, self.normalize, self.capacity_factor = scoring, normalize, capacity_factor
        self.balance_coef, self.z_coef, self.balance_mode = balance_coef, z_coef, balance
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.shared = SwiGLU(dim, shared_hidden) if shared_hidden else None
        self.expert_parallel = 1  # the ranks the experts are divided among (``parallel``'s ep sets it)
        self.expert_context = ExpertContext()  # where its experts and its sequences' other tokens are (the ep axis's)
        self.tokens_per_expert: Tensor | None = None
        self.dropped: Tensor | None = None
        self.balance: Tensor | None = None
        self.z: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w, fan_in in ((self.w1, self.dim), (self.w3, self.dim), (self.w2, self.hidden)):
            if not w.is_meta:
                nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    @property
    def local_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        context = self.expert_context
        ep = context.ep if context.ep is not None and context.ep.active else None
        if (ep.world_size if ep is not None else 1) != self.expert_parallel:
            raise RuntimeError(f"This MoE layer's experts are divided among {self.expert_parallel} ranks, but its "
                               f"forward runs with an expert-parallel group of {ep.world_size if ep else 1}: run it "
                               "under the strategy that divided them.")
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        plain = torch.autocast(x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") else nullcontext()
        with plain:  # routing decisions in fp32
            logits = F.linear(tokens.float(), self.router.weight.float())
        probs, weights, experts = route(logits, self.top_k, self.scoring, self.normalize)
        keep = None
        if self.capacity_factor is not None:
            capacity = capacity_of(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            keep = within_capacity(experts, self.num_experts, capacity)
        if self.training:
            sequences = shape[0] if x.dim() == 3 else 1
            self.balance = balance_loss(probs, experts, sequences, self.balance_mode, context.sequence,
                                        context.slices)
            self.z = z_loss(logits, context.slices)
            terms = self.balance_coef * self.balance + self.z_coef * self.z
            add_auxiliary_loss(terms, tokens.shape[0] * context.slices, self)
            self.balance, self.z = self.balance.detach(), self.z.detach()
        compute = partial(experts_forward, w1=self.w1, w3=self.w3, w2=self.w2)
        routed, counts = dispatch(tokens, experts, weights.to(x.dtype), keep, self.num_experts, compute, ep)
        if self.training:
            self.tokens_per_expert = counts.detach()
            self.dropped = 1 - counts.sum().float() / experts.numel()  # 0 when dropless
        if self.shared is not None:
            routed = routed + self.shared(tokens)
        return routed.view(shape)

    def extra_repr(self) -> str:
        routing = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return (f"dim={self.dim}, hidden={self.hidden}, experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, {routing}, local_experts={self.local_experts}")
