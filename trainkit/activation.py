"""Activation checkpointing: recompute chosen submodules in backward instead of storing activations."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(
    module: nn.Module, policy: Sequence[type[nn.Module]] | Callable[[nn.Module], bool]
) -> int:
    """Wrap the forward of every submodule ``policy`` selects with non-reentrant checkpointing.

    The wrapper replaces ``forward`` on the instance, so parameter names (and so checkpoints) do not
    change. Nested matches are wrapped only at the outermost level. Returns how many were wrapped.
    """
    if callable(policy) and not isinstance(policy, type):
        selects = policy
    else:
        classes = tuple(policy) if isinstance(policy, Sequence) else (policy,)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"activation_checkpointing takes nn.Module classes or a policy callable; got {policy!r}.")
        selects = lambda m: isinstance(m, classes)
    wrapped = 0

    def visit(mod: nn.Module, is_root: bool) -> None:
        nonlocal wrapped
        if not is_root and selects(mod):
            if not getattr(mod, "_trainkit_checkpointed", False):
                original = mod.forward
                mod.forward = functools.wraps(original)(
                    lambda *args, _f=original, **kwargs: checkpoint(_f, *args, use_reentrant=False, **kwargs)
                )
                mod._trainkit_checkpointed = True
            wrapped += 1
            return
        for child in mod.children():
            visit(child, False)

    visit(module, True)
    if wrapped == 0:
        raise ValueError(f"activation_checkpointing={policy!r} matched no submodule of {type(module).__name__}.")
    return wrapped
