"""Activation checkpointing: recompute chosen submodules in backward instead of storing activations.

Two ways to recompute a checkpointed module:

- ``"full"``: store its inputs only and run its whole forward again in backward (about one more forward).
- ``"selective"`` (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models"): keep
  what is expensive to compute and cheap to store, the outputs of matrix multiplications and of fused attention
  kernels, and recompute the rest in backward (norms, activation functions, residual adds, softmax, dropout, copies).
  A batched product larger than its inputs (an attention score matrix, s x s per head, when attention is written
  out) is recomputed too: that is the memory-hungry part the paper removes. So is a row-parallel layer's product under
  tensor parallelism: a partial sum of the full sequence and width on every rank, read by nothing in backward once
  reduced (Megatron-LM keeps no copy of it either). Built on torch's selective-checkpoint
  policy API (``create_selective_checkpoint_contexts``).

``every=k`` checkpoints one selected module in k (the first, the (k+1)-th, ...): memory between none and all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import trainkit_strategies.context.ring  # noqa: F401  (registers trainkit::cp_attention)
from trainkit_strategies.planning.memory import ActivationMeter, in_partial_products
from trainkit_strategies.sharding.units import repeated_layers

MODES = ("full", "selective")
Policy = Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | str

_aten = torch.ops.aten
# Products worth keeping: matrix multiplications (an nn.Linear is an addmm/mm on a flattened view) and the fused
# attention kernels (their outputs are the attention output and a per-row log-sum-exp: O(s), not O(s^2)).
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}
for _name in ("_scaled_mm", "_grouped_mm"):  # fp8 and grouped matmuls, where this torch has them
    if hasattr(_aten, _name):
        SAVED_OPS.add(getattr(_aten, _name).default)
SAVED_OPS.add(torch.ops.trainkit.cp_attention.default)  # attention across a context-parallel group: never replayed


def _numel(x: Any) -> int:
    return sum(t.numel() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the outputs of matmuls and fused attention kernels, except a batched product larger than its inputs
    (attention written out: q @ k^T, s x s per head) and a product marked as a partial sum about to be reduced
    (``partial_products``: a row-parallel layer's, whole-size on every tensor-parallel rank); recompute everything
    else. What is saved is counted by any active
    ``ActivationMeter`` (torch keeps it outside autograd's saved-tensor hooks)."""
    if op in SAVED_OPS and not in_partial_products():
        out = getattr(ctx, "op_output", None)
        inputs = [t for t in args if isinstance(t, torch.Tensor)]
        batched = op in (_aten.bmm.default, _aten.baddbmm.default)  # nn.Linear is mm/addmm on a flattened view
        if out is None or not batched or _numel(out) <= max(t.numel() for t in inputs):
            if out is not None and not ctx.is_recompute:
                for tensor in tree_leaves(out):
                    if isinstance(tensor, torch.Tensor):
                        ActivationMeter.note_saved(tensor)
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


def _selector(module: nn.Module, policy: Policy) -> Callable[[nn.Module], bool]:
    if isinstance(policy, str):
        blocks = repeated_layers(module)
        if not blocks:
            raise ValueError(f"activation_checkpointing={policy!r} checkpoints the model's repeated blocks (the "
                             f"children of an nn.ModuleList or nn.Sequential that share a class), and "
                             f"{type(module).__name__} has none: pass the module classes to checkpoint instead, "
                             "e.g. activation_checkpointing=[MyBlock].")
        ids = {id(b) for b in blocks}
        return lambda m: id(m) in ids
    if callable(policy) and not isinstance(policy, type):
        return policy
    classes = tuple(policy) if isinstance(policy, Sequence) else (policy,)
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError("activation_checkpointing takes \"full\", \"selective\", nn.Module classes or a policy "
                        f"callable; got {policy!r}.")
    return lambda m: isinstance(m, classes)


def resolve_mode(policy: Policy | None, mode: str | None = None) -> str:
    """The recompute mode ``policy`` asks for: a string names it, classes and callables mean ``"full"`` unless
    ``mode`` says otherwise."""
    chosen = policy if isinstance(policy, str) else (mode or "full")
    if chosen not in MODES:
        raise ValueError(f"activation_checkpointing={chosen!r} is not a recompute mode: use one of {MODES}, module "
                         "classes, or a module -> bool policy.")
    return chosen


def apply_activation_checkpointing(module: nn.Module, policy: Policy, mode: str | None = None, every: int = 1) -> int:
    """Wrap the forward of every submodule ``policy`` selects with non-reentrant checkpointing.

    ``policy``: ``"full"`` or ``"selective"`` (the model's repeated blocks, recomputed that way), module classes,
    or a ``module -> bool`` callable (recomputed as ``mode`` says, default ``"full"``). ``every=k`` wraps one
    selected module in k, the first of each k. The wrapper replaces ``forward`` on the instance, so parameter names
    (and so checkpoints) do not change. Nested matches are wrapped only at the outermost level. Returns how many
    were wrapped.
    """
    mode = resolve_mode(policy, mode)
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"activation_checkpointing_every={every!r} must be a positive integer (1: every block).")
    selects = _selector(module, policy)
    extra: dict[str, Any] = {"context_fn": _selective_contexts} if mode == "selective" else {}
    matched = wrapped = 0

    def visit(mod: nn.Module, is_root: bool) -> None:
        nonlocal matched, wrapped
        if not is_root and selects(mod):
            if matched % every == 0:
                if not getattr(mod, "_trainkit_checkpointed", False):
                    mod._trainkit_recomputed = mod.forward  # what the checkpoint runs (compile_blocks compiles it)
                    mod.forward = functools.wraps(mod.forward)(
                        lambda *args, _m=mod, **kwargs: checkpoint(_m._trainkit_recomputed, *args, use_reentrant=False,
                                                                   **extra, **kwargs))
                    mod._trainkit_checkpointed = mode
                wrapped += 1
            matched += 1
            return
        for child in mod.children():
            visit(child, False)

    visit(module, True)
    if matched == 0:
        raise ValueError(f"activation_checkpointing={policy!r} matched no submodule of {type(module).__name__}.")
    return wrapped
