"""Tensor-parallel plans from Hugging Face ``transformers`` models, without importing ``transformers``.

A ``PreTrainedModel`` declares how its layers split: ``config.base_model_tp_plan`` for the base model's submodules
(``"layers.*.self_attn.q_proj": "colwise"``) and the class's ``_tp_plan`` for the head (``"lm_head":
"colwise_gather_output"``). ``plan_of`` finds such models inside a module (by those attributes) and turns their plans
into ours, with the entries sequence parallelism needs, since Hugging Face's plans have none:

- ``<layers>.0``: ``split_sequence`` (the first decoder layer takes its slice of the sequence; positions and the
  causal mask are made from the whole sequence before it);
- every module holding the plan's column-parallel projections (attention, MLP): ``gather_sequence`` (the sequence
  gathered at its input, as torchtitan's ``PrepareModuleInput`` does, because Hugging Face attention reshapes its
  output with its input's shape);
- an embedding whose weight the head shares (``tie_word_embeddings``): ``embedding`` with its output summed whole.

An entry of a style we cannot honour is an error naming it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainkit_strategies.tensor.plan import Embedding, GatherSequence, SplitSequence

STYLE_NAMES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "lm_head"}


def pretrained_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models inside ``module`` (itself included), by qualified name."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "base_model_tp_plan") and hasattr(sub, "base_model_prefix"):
            found.append((name, sub))
    return found


def _joined(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def plan_of(module: nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel plan of the Hugging Face models ``module`` holds (None: it holds none, or they declare
    no plan)."""
    plan: dict[str, Any] = {}
    for name, model in pretrained_models(module):
        base_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
        if not base_plan:
            continue
        prefix = model.base_model_prefix
        base = _joined(name, prefix) if hasattr(model, prefix) else name
        entries = {_joined(base, k): v for k, v in base_plan.items()}
        entries |= {_joined(name, k): v for k, v in (getattr(type(model), "_tp_plan", None) or {}).items()}
        for pattern, style in entries.items():
            ours = STYLE_NAMES.get(style)
            if ours is None:
                raise ValueError(
                    f"{type(model).__name__}'s tensor-parallel plan gives {pattern!r} the style {style!r}, which "
                    f"trainkit does not run (it runs {', '.join(STYLE_NAMES)}); write tensor_parallel_plan() on your "
                    "module with trainkit's styles (docs/huggingface.md), or train without tp."
                )
            plan[pattern] = ours
        layered = [p for p in entries if ".*." in p]
        if layered:
            layers = layered[0].split(".*.", 1)[0]
            plan[f"{layers}.0"] = SplitSequence()
            for pattern in {p.rsplit(".", 1)[0] for p, s in entries.items() if s == "colwise"}:
                plan[pattern] = GatherSequence()
        head = next((p for p, s in plan.items() if s == "lm_head"), None)
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        if head is not None and embeddings is not None:
            lm_head = model.get_submodule(head[len(name) + 1 :] if name else head)
            if getattr(lm_head, "weight", None) is embeddings.weight:  # tied: split alike, summed whole
                embedding_name = next(n for n, m in module.named_modules() if m is embeddings)
                plan[embedding_name] = Embedding(whole_output=True)
    return plan or None
