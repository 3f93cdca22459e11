"""Context parallelism for Hugging Face models, unchanged: their attention runs ``context/ring.py``'s, and they see the
rank's real token positions.

``adopt(module)`` does both for every ``transformers`` model inside ``module`` (found by its config, without importing
``transformers`` until one is there): it registers an attention implementation (transformers' ``AttentionInterface``,
named ``trainkit_cp``) that runs ``attention`` across the context-parallel group (grouped key/value heads repeated to
the query heads, causal as the module says), switches the models to it, and gives each base model the positions of the
rank's two chunks of every sequence as ``position_ids`` (rotary embeddings follow them) whenever a context-parallel
forward runs and the caller passed none. Outside a context-parallel forward the attention is
``F.scaled_dot_product_attention`` and the positions are left to the model, so one process computes what Hugging Face's
``sdpa`` does.

Limits: causal self-attention without padding (an attention mask other than the causal one is refused under cp), no
attention dropout (as for any model under cp), no key/value cache.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from trainkit_strategies.context.ring import attention, current, positions
from trainkit_strategies.tensor.huggingface import pretrained_models

NAME = "trainkit_cp"
UNMASKED = "trainkit_causal"  # the same attention, with no mask made for it (``without_masks``)
_registered = False


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-interface signature: ``[batch, heads, tokens, dim]`` in, ``[batch, tokens, heads,
    dim]`` out."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    causal = bool(getattr(module, "is_causal", True))
    if current() is not None and attention_mask is not None and attention_mask.dtype == query.dtype and \
            attention_mask.shape[-1] != key.shape[-2]:
        raise ValueError("Context parallelism runs causal attention without padding: drop the attention mask.")
    out = attention(query, key, value, is_causal=causal, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention implementation with transformers (once); its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        AttentionInterface.register(NAME, attention_forward)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        AttentionInterface.register(UNMASKED, attention_forward)  # no mask function: transformers makes none
        _registered = True
    return NAME


def _positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if current() is None or kwargs.get("position_ids") is not None:
        return args, kwargs
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    kwargs = {**kwargs, "position_ids": positions(tokens.shape[1], tokens.device).unsqueeze(0)}
    return args, kwargs


def _switch(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def without_masks(module: nn.Module) -> int:
    """Switch the Hugging Face models inside ``module`` to this attention (causal, across the context-parallel group
    under cp) with no attention mask made for it: how ``trainkit estimate`` steps them on the meta device, where
    transformers' mask code would read values a meta tensor has none of (whether sequences are packed). The shapes,
    and the collectives a strategy issues, are a run's. How many it found."""
    found = pretrained_models(module)
    for _, model in found:
        register()
        _switch(model, UNMASKED)
    return len(found)


def adopt(module: nn.Module) -> int:
    """Run every Hugging Face model inside ``module`` under context parallelism (see the module docstring); how
    many it found."""
    found = pretrained_models(module)
    for _, model in found:
        _switch(model, register())
        base = getattr(model, model.base_model_prefix, model)
        base.register_forward_pre_hook(_positions, with_kwargs=True)
    return len(found)
