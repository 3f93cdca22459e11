"""What a module needs to run under ``strategy="parallel"``: for tensor parallelism a plan, for context parallelism
``attention`` and ``positions``.

A ``TrainModule`` declares ``tensor_parallel_plan() -> {pattern: style}``: qualified submodule names (``*`` for one
component) to a style, a string or one of the classes here (``Colwise(parts=3)`` for a fused q/k/v projection). See
docs/parallel.md for how to write one, and ``trainkit.demo.gpt.DemoGPT`` or ``examples/llama.py`` for two.

Under context parallelism (``cp`` > 1) each rank holds two chunks of every sequence: a module computes attention with
``attention(q, k, v, is_causal=True)`` (``F.scaled_dot_product_attention`` when there is no ``cp``; across the group
when there is) and takes its token positions from ``positions(n, device)`` (``arange(n)`` when there is no ``cp``; the
rank's real indices when there is), so learned and rotary position embeddings follow them.
"""

from __future__ import annotations

from trainkit_strategies.context.ring import attention, positions
from trainkit_strategies.tensor.loss import VocabShard
from trainkit_strategies.tensor.plan import (
    STYLES,
    Colwise,
    Embedding,
    GatherSequence,
    Heads,
    LMHead,
    Rowwise,
    Sequence,
    SplitSequence,
    Style,
)

__all__ = ["STYLES", "Colwise", "Embedding", "GatherSequence", "Heads", "LMHead", "Rowwise", "Sequence",
           "SplitSequence", "Style", "VocabShard", "attention", "positions"]
