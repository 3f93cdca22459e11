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

from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.tensor.plan import (
    Colwise,
    Embedding,
    GatherOutput,
    GatherSequence,
    Heads,
    LMHead,
    Rowwise,
    SplitSequence,
)

STYLE_NAMES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "lm_head"}

# Plans for architectures Hugging Face ships without one: (the base model's entries, the head's), in its names,
# as trainkit's style objects.
# GPT-2's Conv1D layers hold their weights as [in, out] (the styles split them along the matching dimension); its
# q, k and v are one fused projection, and its attention splits that projection's output by ``split_size``.
KNOWN_PLANS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # the final hidden states are reshaped with the input's shape after ln_f: the sequence is gathered whole there
    "gpt2": ({"h.*.attn.c_attn": Colwise(parts=3), "h.*.attn.c_proj": Rowwise(), "h.*.mlp.c_fc": Colwise(),
              "h.*.mlp.c_proj": Rowwise(), "h.*.attn": Heads(("num_heads", "split_size")), "ln_f": GatherOutput()},
             {"lm_head": LMHead(whole_input=True)}),
}


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


def _ours(model: nn.Module, pattern: str, style: Any) -> Any:
    if not isinstance(style, str):
        return style  # a style object of ours (a known plan's)
    if style not in STYLE_NAMES:
        raise ConfigurationError(
            f"{type(model).__name__}'s tensor-parallel plan gives {pattern!r} the style {style!r}, which trainkit does "
            f"not run (it runs {', '.join(STYLE_NAMES)}); write tensor_parallel_plan() on your module with trainkit's "
            "styles (docs/huggingface.md), or train without tp."
        )
    return STYLE_NAMES[style]


def plan_of(module: nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel plan of the Hugging Face models ``module`` holds (None: it holds none, or they declare
    no plan and trainkit knows none for them)."""
    plan: dict[str, Any] = {}
    for name, model in pretrained_models(module):
        base_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
        head_plan = dict(getattr(type(model), "_tp_plan", None) or {})
        if not base_plan:
            base_plan, known_head = KNOWN_PLANS.get(getattr(model.config, "model_type", ""), ({}, {}))
            head_plan = head_plan or known_head
        if not base_plan:
            continue
        prefix = model.base_model_prefix
        base = _joined(name, prefix) if hasattr(model, prefix) else name
        entries = {_joined(base, k): _ours(model, _joined(base, k), v) for k, v in base_plan.items()}
        entries |= {_joined(name, k): _ours(model, _joined(name, k), v) for k, v in head_plan.items()
                    if hasattr(model, k.split(".")[0])}
        extra: dict[str, list[Any]] = {}
        layered = [p for p in entries if ".*." in p]
        if layered:
            extra.setdefault(f"{layered[0].split('.*.', 1)[0]}.0", []).append(SplitSequence())
            for pattern, style in entries.items():
                if style == "colwise" or isinstance(style, Colwise):
                    extra.setdefault(pattern.rsplit(".", 1)[0], []).append(GatherSequence())
        for pattern, added in extra.items():
            mine = entries.get(pattern)
            styles = [mine, *dict.fromkeys(added)] if mine is not None else list(dict.fromkeys(added))
            entries[pattern] = styles[0] if len(styles) == 1 else styles
        plan |= entries
        head = next((p for p, s in plan.items() if s == "lm_head" or isinstance(s, LMHead)), None)
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        if head is not None and embeddings is not None:
            lm_head = module.get_submodule(head)
            if getattr(lm_head, "weight", None) is embeddings.weight:  # tied: split alike, summed whole
                embedding_name = next(n for n, m in module.named_modules() if m is embeddings)
                plan[embedding_name] = Embedding(whole_output=True)
    return plan or None


def indivisible_heads(module: nn.Module, tp: int) -> str | None:
    """Why the Hugging Face models in ``module`` cannot be split over ``tp`` ranks by heads (their attention reshapes
    a projection's columns into whole heads of ``head_dim``), or None."""
    for name, model in pretrained_models(module):
        config = model.config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
            if isinstance(count, int) and count % tp:
                return (f"{name or type(model).__name__} has {count} {what} (config.json), which {tp} tensor-parallel "
                        f"ranks cannot share: choose a tp that divides {count}.")
    return None
