"""Mixtures of experts: the ``MoE`` layer and what to log of it.

``MoE(dim, hidden, experts, top_k=2, ...)`` replaces a transformer block's MLP (see ``examples/moe.py`` for a
Mixtral-shaped model). Its load-balancing and z-losses join the training objective by themselves (the step adds the
terms its layers report, weighted as the loss is), so ``training_step`` returns the language-model loss alone; log
what the layers did with ``self.log_dict(moe_metrics(self), sync_dist=True)``. Under ``strategy="parallel"`` with
``ep`` > 1 the experts are divided among the expert-parallel ranks and tokens travel to them by all-to-all; the
module does not change. docs/moe.md says more.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from trainkit_strategies.experts.layer import MoE, SwiGLU

__all__ = ["MoE", "SwiGLU", "moe_metrics"]


def moe_metrics(module: nn.Module) -> dict[str, Tensor]:
    """What the MoE layers of ``module`` did in their last training forward: the mean of their balance losses
    (``moe/balance_loss``: 1 when balanced) and z-losses, the fraction of assignments dropped (``moe/dropped``, 0
    when dropless), and the assignments each expert took summed over the layers (``moe/tokens/expert{e}``; with
    ``sync_dist=True`` their mean over the ranks) with the busiest expert's share against the mean
    (``moe/imbalance``: 1 when balanced)."""
    layers = [m for m in module.modules() if isinstance(m, MoE) and m.tokens_per_expert is not None]
    if not layers:
        return {}
    out = {"moe/balance_loss": torch.stack([m.balance for m in layers]).mean(),
           "moe/z_loss": torch.stack([m.z for m in layers]).mean(),
           "moe/dropped": torch.stack([m.dropped for m in layers]).mean()}
    if len({m.num_experts for m in layers}) == 1:
        tokens = torch.stack([m.tokens_per_expert for m in layers]).sum(0).float()
        out["moe/imbalance"] = tokens.max() / tokens.mean().clamp(min=1)
        out |= {f"moe/tokens/expert{e}": tokens[e] for e in range(tokens.numel())}
    return out
