"""Hugging Face MoE blocks under expert parallelism, without importing ``transformers``.

transformers 5.x holds a sparse MoE block's experts as one module (``MixtralExperts``, ``Qwen2MoeExperts``, ...):
packed weights ``gate_up_proj`` [experts, 2 * intermediate, hidden] and ``down_proj`` [experts, hidden, intermediate],
called by its block as ``experts(hidden, top_k_index, top_k_weights)`` after the block's router chose each token's
experts and weights. ``use_experts_implementation`` records that layout on the module (``is_concatenated``,
``is_transposed``, ``has_bias``, ``has_gate``, ``has_post_expert_norm``) and gives it the default gate; with the
defaults, every family computes expert e on a token x as transformers' eager forward does:
``gate, up = (x @ gate_up_proj[e].T).chunk(2, -1)``, ``(act_fn(gate) * up) @ down_proj[e].T``, weighted by the
token's router weight. In transformers 5.x these are Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, PhiMoE,
GraniteMoE, Jamba, Qwen3-Next, MiniMax, ERNIE-4.5-MoE, GLM-4-MoE, FlexOlmo, HunYuan-MoE and LFM2-MoE.

``divide`` cuts both weights along dimension 0 to this rank's contiguous block of E/ep experts (on the meta model:
only that block is ever allocated) and gives the module a forward that sends each token's rows to the ranks holding
its experts and back through ``dispatch.py``'s all-to-all, computing each expert as above. The router, a shared
expert (Qwen2-MoE's, DeepSeek-V3's), the norms and everything else stay replicated and run as transformers wrote
them, so the routing weights are the router's own (its top-k normalisation, DeepSeek's grouped routing and
correction bias). Experts held another way (GPT-OSS's transposed weights with biases and clamped gate, DBRX's,
a list of expert modules) are refused by family, with what trains them.
"""

from __future__ import annotations

import types
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from trainkit_strategies.experts.context import ExpertContext
from trainkit_strategies.experts.dispatch import by_expert, dispatch, gmm
from trainkit_strategies.tensor.huggingface import pretrained_models

PACKED = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
          "has_post_expert_norm": False}  # transformers' ``use_experts_implementation`` defaults
FAMILIES = "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and the other families that hold them so"


def experts_modules(module: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """The expert modules of the Hugging Face models inside ``module``: (the model's ``model_type``, the qualified
    name, the module) for every ``*Experts`` module and every module named ``experts``."""
    found = []
    for prefix, model in pretrained_models(module):
        family = getattr(model.config, "model_type", type(model).__name__)
        for name, sub in model.named_modules():
            if type(sub).__name__.endswith("Experts") or name.rsplit(".", 1)[-1] == "experts":
                found.append((family, ".".join(p for p in (prefix, name) if p), sub))
    return found


def unpacked(experts: nn.Module) -> str | None:
    """Why ``experts`` does not hold its experts as transformers' packed default layout, or None where it does."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "no packed gate_up_proj and down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] or \
            gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
    differs = [f"{flag}={getattr(experts, flag, None)}" for flag, value in PACKED.items()
               if getattr(experts, flag, None) is not value]
    if differs:
        return ", ".join(differs)
    gate = getattr(type(experts), "_apply_gate", None)
    if getattr(gate, "__module__", "") != "transformers.integrations.moe":
        return "a gate of its own (_apply_gate)"
    return None


def divide(experts: nn.Module, size: int, context: ExpertContext) -> None:
    """``experts`` (packed, ``unpacked`` None; already cut to this rank's block of E/``size``) computes its block
    and exchanges rows with the expert-parallel group of ``context``."""
    experts.expert_context = context
    experts.expert_parallel = size
    experts.forward = types.MethodType(_forward, experts)


def _forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward (its signature, its sum ``sum_k weight_k * expert_k(x)``), each token's rows
    computed on the rank holding its expert."""
    ep = self.expert_context.ep
    if ep is None or ep.world_size != self.expert_parallel:
        raise RuntimeError(f"This Hugging Face MoE block's experts are divided among {self.expert_parallel} ranks, but "
                           f"its forward runs with an expert-parallel group of {ep.world_size if ep else 1}: run it "
                           "under the strategy that divided them.")
    compute = partial(packed_forward, gate_up=self.gate_up_proj, down=self.down_proj, act=self.act_fn)
    whole = self.gate_up_proj.shape[0] * self.expert_parallel
    out, _ = dispatch(hidden_states, top_k_index, top_k_weights, None, whole, compute, ep)
    return out


def packed_forward(x: Tensor, counts: list[int], gate_up: Tensor, down: Tensor, act: nn.Module) -> Tensor:
    """Each expert on its rows of ``x`` (sorted by expert, ``counts[e]`` rows for expert e), as transformers
    computes it: ``gate, up = (x @ gate_up[e].T).chunk(2, -1)``, ``(act(gate) * up) @ down[e].T``."""

    def grouped(offsets: Tensor) -> Tensor:
        gate, up = gmm(x, gate_up.transpose(1, 2), offsets).chunk(2, -1)
        return gmm(act(gate) * up, down.transpose(1, 2), offsets)

    def each(part: Tensor, e: int) -> Tensor:
        gate, up = F.linear(part, gate_up[e]).chunk(2, -1)
        return F.linear(act(gate) * up, down[e])

    return by_expert(x, counts, grouped, each, down.shape[1])
