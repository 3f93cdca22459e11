"""The ``ep`` axis of ``strategy="parallel"``: the experts of every ``MoE`` layer, and of every Hugging Face MoE block
whose experts transformers holds packed (``huggingface.py``), divided among the ranks of an expert-parallel group,
tokens sent to their experts and back by all-to-all (``dispatch.py``).

The group is drawn from the data-parallel ranks, as torchtitan and DeepSpeed-MoE draw it: its ranks read different
batches, and everything but the experts is replicated across it (the layout's other axes shard and split it as
they would without ``ep``). So after the data-parallel engine has reduced the gradients over its own group, the
gradients of everything but the experts are summed across the ``ep`` group too (each of its ranks saw other
tokens), while an expert's gradient already holds every token the group routed to it (the all-to-all's backward
brought them home). Norms count a replicated parameter on the group's first rank and each expert on its owner
(``Dividing``). Rank ``r`` holds experts ``r * E/ep ... (r + 1) * E/ep - 1`` of every layer: a contiguous block along
the stacked weights' first dimension, which checkpoints record as such (so they resume at any ``ep``).

The transform also gives every MoE layer its ``ExpertContext`` (where its experts and the rest of its sequences
are), at any ``ep``: under context or sequence parallelism the load-balancing loss sums over the ranks holding the
other tokens of a sequence.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from trainkit_strategies.axis import Dividing
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.experts.context import ExpertContext
from trainkit_strategies.experts.huggingface import FAMILIES, divide, experts_modules, unpacked
from trainkit_strategies.experts.layer import MoE
from trainkit_strategies.init.materialise import keep_part
from trainkit_strategies.tensor.layers import Split
from trainkit_strategies.tensor.planned import same_start


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


class ExpertParallel(Dividing):
    """The experts of a module divided over ``comm`` (the expert-parallel group)."""

    name = "ep"

    def __init__(self, comm: Comm, context: ExpertContext) -> None:
        super().__init__(comm)
        self.context = context
        self._bytes = 0

    @classmethod
    def of(cls, layout: Any) -> ExpertParallel:
        """For ``layout`` (a ``ParallelStrategy`` whose mesh is made), at any ``ep``: its MoE layers are told where
        the other tokens of their sequences are (the context-parallel ranks, and the tensor-parallel ones under
        sequence parallelism, each of which routes a slice)."""
        ep, sp = layout.mesh.comm("ep"), layout.sequence_parallel
        sequence = layout.mesh.comm(("cp", "tp") if sp else ("cp",))
        return cls(ep, ExpertContext(ep if ep.active else None, sequence, layout.tp if sp else 1))

    def transform(self, module: nn.Module, device: Any) -> None:
        """Cut every MoE layer's (and Hugging Face MoE block's) stacked expert weights to this rank's block of
        experts (from the group's first rank's values), and give every MoE layer its context."""
        if self.comm.active:
            same_start(module, self.comm, device)
            self._divide(module)
        for layer in moe_layers(module):
            layer.expert_context = self.context

    def _divide(self, module: nn.Module) -> None:
        """Check every layer first (a refusal leaves the model as it was), then cut each to this rank's block."""
        size = self.comm.world_size
        layers, packed = moe_layers(module), experts_modules(module)
        if not layers and not packed:
            raise ConfigurationError(f"parallel: ep={size} divides the experts of trainkit.moe.MoE layers and of "
                                     f"Hugging Face MoE blocks ({FAMILIES}), and {type(module).__name__} has none: "
                                     "use ep=1, or build the model with MoE layers.")
        for family, name, experts in packed:
            why = unpacked(experts)
            if why is not None:
                raise ConfigurationError(
                    f"parallel: ep={size} divides Hugging Face experts held as transformers' packed default "
                    f"(gate_up_proj [E, 2I, H] and down_proj [E, H, I], gate then up, no bias: {FAMILIES}); "
                    f"{family}'s {name} ({type(experts).__name__}) differs: {why}. Train {family} with ep=1 "
                    "(dp_shard shards its experts with the rest of the model).")
        for count in {layer.num_experts for layer in layers} | {e.gate_up_proj.shape[0] for _, _, e in packed}:
            if count % size:
                raise ConfigurationError(f"parallel: ep={size} does not divide the {count} experts of a MoE layer: "
                                         f"use an ep that divides {count}.")
        for layer in layers:
            self._keep(layer, ("w1", "w3", "w2"))
            layer.expert_parallel = size
        for _, _, experts in packed:
            self._keep(experts, ("gate_up_proj", "down_proj"))
            divide(experts, size, self.context)

    def _keep(self, module: nn.Module, names: tuple[str, ...]) -> None:
        """Cut ``module``'s stacked expert weights ``names`` to this rank's block of experts along dimension 0."""
        for name in names:
            param = getattr(module, name)
            split = Split(0, self.comm.world_size)
            keep_part(param, partial(split.local, rank=self.rank), partial(split.view, rank=self.rank))
            self.splits[param] = split
            self._bytes += param.numel() * param.element_size()

    def comms(self) -> list[Comm]:
        return [self.comm] if self.comm.active else []

    def held(self) -> int:
        """Bytes of the experts' weights this rank computes with (its E/ep of every layer's, as divided; their
        gradients and optimizer state follow them, sharded further where dp_shard > 1)."""
        return self._bytes

    def describe(self) -> str:
        return f"expert weights {self.held() / 1e6:.2f} MB per rank" if self.comm.active else ""
