"""What a module needs to run under ``strategy="parallel"`` with tensor parallelism: a plan.

A ``TrainModule`` declares ``tensor_parallel_plan() -> {pattern: style}``: qualified submodule names (``*`` for one
component) to a style, a string or one of the classes here (``Colwise(parts=3)`` for a fused q/k/v projection). See
docs/parallel.md for how to write one, and ``trainkit.demo.gpt.DemoGPT`` or ``examples/llama.py`` for two.
"""

from __future__ import annotations

from trainkit_strategies.tensor.loss import VocabShard
from trainkit_strategies.tensor.plan import STYLES, Colwise, Embedding, Heads, LMHead, Rowwise, Sequence, Style

__all__ = ["STYLES", "Colwise", "Embedding", "Heads", "LMHead", "Rowwise", "Sequence", "Style", "VocabShard"]
