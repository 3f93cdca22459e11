"""The ``ep`` axis of ``strategy="parallel"``: the experts of every ``MoE`` layer divided among the ranks of an
expert-parallel group, tokens sent to their experts and back by all-to-all (``dispatch.py``).

The group is drawn from the data-parallel ranks, as torchtitan and DeepSpeed-MoE draw it: its ranks read different
batches, and everything but the experts is replicated across it (the layout's other axes shard and split it as
they would without ``ep``). So after the data-parallel engine has reduced the gradients over its own group, the
gradients of everything but the experts are summed across the ``ep`` group too (each of its ranks saw other
tokens), while an expert's gradient already holds every token the group routed to it (the all-to-all's backward
brought them home). Norms count a replicated parameter on the group's first rank and each expert on its owner.
Rank ``r`` holds experts ``r * E/ep ... (r + 1) * E/ep - 1`` of every layer: a contiguous block along the stacked
weights' first dimension, which checkpoints record as such (so they resume at any ``ep``).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor, nn

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.experts.layer import MoE
from trainkit_strategies.tensor.layers import Split


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


class ExpertParallel:
    """The experts of a module divided over ``comm`` (the expert-parallel group)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.splits: dict[Tensor, Split] = {}  # each expert weight -> how it was divided
        self._bytes = 0

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def divide(self, module: nn.Module) -> None:
        """Cut every MoE layer's stacked expert weights to this rank's block of experts."""
        layers = moe_layers(module)
        if not layers:
            raise ConfigurationError(f"parallel: ep={self.size} divides the experts of trainkit.moe.MoE layers, and "
                                     f"{type(module).__name__} has none: use ep=1, or build the model with MoE layers.")
        for layer in layers:
            if layer.num_experts % self.size:
                raise ConfigurationError(f"parallel: ep={self.size} does not divide the {layer.num_experts} "
                                         f"experts of a MoE layer: use an ep that divides {layer.num_experts}.")
            for name in ("w1", "w3", "w2"):
                param = getattr(layer, name)
                split = Split(0, self.size)
                param.data = split.local(param.data, self.rank)
                self.splits[param] = split
                self._bytes += param.numel() * param.element_size()
            layer.expert_parallel = self.size

    def replicated(self, params: Collection[Tensor]) -> list[Tensor]:
        """Of ``params``, those every rank of the group holds whole (all but the experts)."""
        return [p for p in params if p not in self.splits]

    def sum_replicated(self, grads: list[Tensor]) -> None:
        """Sum ``grads`` (of the replicated parameters) across the group, in one all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            self.comm.all_reduce(flat)
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def held(self) -> int:
        """Bytes of the experts' weights this rank computes with (its E/ep of every layer's, as divided; their
        gradients and optimizer state follow them, sharded further where dp_shard > 1)."""
        return self._bytes
