"""Tensor-parallel plans: which submodule of a model becomes which parallel layer.

A module declares its plan as ``tensor_parallel_plan() -> {pattern: style}``. A pattern is a submodule's qualified
name in which ``*`` stands for one name component (``"blocks.*.attn.qkv"``); a style is one of the strings below or
a style object (``Colwise(parts=3)`` for a fused q/k/v projection):

=============  ===========================================================================================
``colwise``    ``nn.Linear`` with output features split (``Colwise(parts=k)``: ``k`` fused blocks, each split)
``rowwise``    ``nn.Linear`` with input features split (follows a ``colwise`` layer)
``embedding``  ``nn.Embedding`` with the vocabulary split
``lm_head``    ``nn.Linear`` producing the vocabulary's logits, split by vocabulary (``F.cross_entropy`` on
               them never gathers them; see ``loss.py``)
``sequence``   any module whose output runs along the sequence (a learned position embedding): under
               sequence parallelism each rank keeps its slice of it
``heads``      an attention module: its head counts (``n_head``, ``num_key_value_heads``, ...) are divided
               by tp, for code that reshapes with them
``gather_sequence``  an attention or MLP module: under sequence parallelism its input (a slice of the sequence)
               is gathered whole at its input, once, and its column-parallel layers take it as it is (torchtitan's
               ``PrepareModuleInput``); for modules that read shapes from their input, as Hugging Face attention
               does (``attn_output.reshape(*input_shape, -1)``)
``split_sequence``   the module where the sequence-parallel region begins: under sequence parallelism it takes
               this rank's slice of its (whole) input; for models that make positions and masks from the whole
               sequence after the embedding (Hugging Face's: ``"model.layers.0"``)
=============  ===========================================================================================

A layer that holds a parameter the plan splits for another layer (a tied embedding, say) must be in the plan too:
setup fails naming it otherwise.

Parameters no style splits are replicated on the tensor-parallel ranks. Under sequence parallelism they act on a
slice of the sequence (norms, biases after a row-parallel layer, positions), so their gradients are partial sums
that the strategy all-reduces across the group; without it they see whole inputs and their gradients agree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

from torch import Tensor, nn

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.init.materialise import keep_part
from trainkit_strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear, Split, VocabParallelEmbedding
from trainkit_strategies.tensor.regions import gather_seq, gather_whole, split_seq

_HEAD_COUNT = re.compile(r"^(n|num)_(\w+_)?heads?$")  # n_head, n_kv_heads, num_attention_heads, ...


@dataclass
class Applied:
    """What applying a plan did: each split parameter's ``Split`` (the rest are replicated)."""

    splits: dict[Tensor, Split] = field(default_factory=dict)
    sequence_parallel: bool = False
    gathered: list[nn.Module] = field(default_factory=list)  # modules whose input is gathered (gather_sequence)

    def replicated(self, module: nn.Module) -> list[Tensor]:
        return [p for p in module.parameters() if p not in self.splits]


@dataclass(frozen=True)
class Style:
    """How one submodule becomes tensor-parallel."""

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        """The module that replaces ``module`` (itself, when it changes in place)."""
        raise NotImplementedError

    @staticmethod
    def _linear(name: str, module: nn.Module, style: str) -> nn.Module:
        if not (isinstance(module, nn.Linear) or _conv1d(module)):
            raise TypeError(f"tensor_parallel_plan: {name!r} is a {type(module).__name__}; the {style!r} style applies "
                            "to nn.Linear layers (and Hugging Face's Conv1D).")
        return module


def _conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (GPT-2): a linear layer whose weight is ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _out_dim(module: nn.Module) -> int:
    """The weight dimension of a layer's output features (1 for a ``Conv1D``)."""
    return 1 if _conv1d(module) else 0


def _split(name: str, param: Tensor | None, split: Split, comm: Comm, done: Applied) -> None:
    """Cut ``param`` to this rank's part, once (a weight tied between two layers is split by the first)."""
    if param is None:
        return
    if param in done.splits:
        if done.splits[param] != split:
            raise ConfigurationError(f"tensor_parallel_plan: {name} is shared with a layer that splits it differently "
                                     f"({done.splits[param]} against {split}); give both layers the same style.")
        return
    split.check(name, tuple(param.shape))
    keep_part(param, partial(split.local, rank=comm.rank), partial(split.view, rank=comm.rank))
    done.splits[param] = split


@dataclass(frozen=True)
class Colwise(Style):
    """Output features split; ``parts``: the output is ``parts`` fused blocks (q, k, v), each split."""

    parts: int = 1

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        linear = self._linear(name, module, "colwise")
        _split(f"{name}.weight", linear.weight, Split(_out_dim(linear), comm.world_size, self.parts), comm, done)
        _split(f"{name}.bias", linear.bias, Split(0, comm.world_size, self.parts), comm, done)
        return ColumnParallelLinear(linear, comm, sequence_parallel)


@dataclass(frozen=True)
class Rowwise(Style):
    """Input features split (the input arrives split by a column-parallel layer); the bias stays whole."""

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        linear = self._linear(name, module, "rowwise")
        _split(f"{name}.weight", linear.weight, Split(1 - _out_dim(linear), comm.world_size), comm, done)
        return RowParallelLinear(linear, comm, sequence_parallel)


@dataclass(frozen=True)
class Embedding(Style):
    """The vocabulary (rows) split; ``whole_output``: the ranks' lookups summed whole (all-reduce) even under
    sequence parallelism, for a model whose sequence-parallel region begins later (``split_sequence``)."""

    whole_output: bool = False

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"tensor_parallel_plan: {name!r} is a {type(module).__name__}; the 'embedding' style "
                            "applies to nn.Embedding.")
        _split(f"{name}.weight", module.weight, Split(0, comm.world_size), comm, done)
        return VocabParallelEmbedding(module, comm, sequence_parallel and not self.whole_output,
                                      split_after=sequence_parallel and self.whole_output)


@dataclass(frozen=True)
class LMHead(Style):
    """Logits split by vocabulary, returned as a ``VocabShard``; ``whole_input``: its input is the whole sequence
    even under sequence parallelism (a model whose region ends earlier, ``gather_output``)."""

    whole_input: bool = False

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        linear = self._linear(name, module, "lm_head")
        _split(f"{name}.weight", linear.weight, Split(_out_dim(linear), comm.world_size), comm, done)
        _split(f"{name}.bias", linear.bias, Split(0, comm.world_size), comm, done)
        return ColumnParallelLinear(linear, comm, sequence_parallel and not self.whole_input, vocab=True)


@dataclass(frozen=True)
class Sequence(Style):
    """The module's output runs along the sequence (dimension -2): sliced to this rank's part under sequence
    parallelism."""

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        if sequence_parallel and comm.active:
            module.register_forward_hook(lambda _m, _args, out: split_seq(out, comm))
        return module


@dataclass(frozen=True)
class Heads(Style):
    """Divide the module's head counts by tp (``names``; default: every integer attribute named like ``n_head``,
    ``num_heads``, ``n_kv_heads``, ``num_key_value_heads``)."""

    names: tuple[str, ...] = ()

    def counts(self, module: nn.Module) -> list[str]:
        if self.names:
            return list(self.names)
        return [k for k, v in vars(module).items() if _HEAD_COUNT.match(k) and isinstance(v, int)
                and not isinstance(v, bool)]

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        counts = self.counts(module)
        if not counts:
            raise ConfigurationError(
                f"tensor_parallel_plan: {name!r} is marked 'heads' but has no head-count attribute "
                "(n_head, num_heads, n_kv_heads, ...); name them: Heads(('my_heads',)).")
        for attr in counts:
            value = getattr(module, attr)
            if value % comm.world_size:
                raise ConfigurationError(
                    f"Tensor parallelism gives each of the tp={comm.world_size} ranks {attr}/tp of {name}'s heads, "
                    f"but {attr}={value} is not divisible by {comm.world_size}: use a tp that divides it."
                )
            setattr(module, attr, value // comm.world_size)
        return module


def _first_input(fn: Callable[[Tensor, Comm], Tensor], comm: Comm) -> Callable:
    """A forward pre-hook applying ``fn`` to a module's first input: its first positional argument, or else its
    ``hidden_states`` (or first tensor) keyword argument."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], Tensor):
            return (fn(args[0], comm), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(
            (k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
        if key is None:
            raise TypeError(f"{type(module).__name__} got no tensor input to gather or split along the sequence.")
        return args, {**kwargs, key: fn(kwargs[key], comm)}

    return hook


@dataclass(frozen=True)
class GatherSequence(Style):
    """Under sequence parallelism: the module's input gathered along the sequence at its input (reduce-scattered in
    backward); the column-parallel layers inside take it whole, the row-parallel ones still scatter their output."""

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        if sequence_parallel and comm.active:
            # first of the module's hooks: the ones there already (a pipeline stage's positions) see it whole
            module.register_forward_pre_hook(_first_input(gather_seq, comm), with_kwargs=True, prepend=True)
            done.gathered.append(module)  # its column-parallel layers take the input whole, once they exist
        return module


@dataclass(frozen=True)
class GatherOutput(Style):
    """Under sequence parallelism: where the region ends, the module's output (its slice of the sequence) gathered
    whole for what follows, which every rank computes alike (a model that reshapes its final hidden states with the
    input's shape, as GPT-2 does)."""

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        if sequence_parallel and comm.active:
            module.register_forward_hook(lambda _m, _args, out: gather_whole(out, comm))
        return module


@dataclass(frozen=True)
class SplitSequence(Style):
    """Under sequence parallelism: the module takes this rank's slice of the sequence of its (whole) input."""

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        if sequence_parallel and comm.active:
            module.register_forward_pre_hook(_first_input(split_seq, comm), with_kwargs=True)
        return module


@dataclass(frozen=True)
class Together(Style):
    """Several styles on one module, applied in order (a plan gives them as a list: ``["heads",
    "gather_sequence"]``)."""

    styles: tuple[Style, ...] = ()

    def apply(self, name: str, module: nn.Module, comm: Comm, sequence_parallel: bool, done: Applied) -> nn.Module:
        for style in self.styles:
            module = style.apply(name, module, comm, sequence_parallel, done)
        return module


def _has(style: Style | None, kind: type) -> bool:
    return isinstance(style, kind) or (isinstance(style, Together) and any(isinstance(s, kind) for s in style.styles))


STYLES: dict[str, Style] = {"colwise": Colwise(), "rowwise": Rowwise(), "embedding": Embedding(),
                            "lm_head": LMHead(), "sequence": Sequence(), "heads": Heads(),
                            "gather_sequence": GatherSequence(), "split_sequence": SplitSequence(),
                            "gather_output": GatherOutput()}


def _pattern(pattern: str) -> re.Pattern:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern))
                      + r"\Z")


def resolve(module: nn.Module, plan: Mapping[str, str | Style]) -> dict[str, Style]:
    """Each submodule's style, by qualified name; fails naming a pattern that matches nothing, an unknown style, or a
    submodule two patterns give different styles."""
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, Style] = {}
    for pattern, given in plan.items():
        if isinstance(given, list | tuple):
            given = Together(tuple(STYLES.get(g, g) if isinstance(g, str) else g for g in given))
            if not all(isinstance(s, Style) for s in given.styles):
                raise ConfigurationError(f"tensor_parallel_plan: unknown style in {pattern!r}'s list; use "
                                         f"{', '.join(STYLES)}, or style objects.")
        style = STYLES.get(given) if isinstance(given, str) else given
        if not isinstance(style, Style):
            raise ConfigurationError(f"tensor_parallel_plan: unknown style {given!r} for {pattern!r}; use one of "
                                     f"{', '.join(STYLES)}, or a style object (Colwise(parts=3)).")
        regex = _pattern(pattern)
        matched = [n for n in names if regex.match(n)]
        if not matched:
            close = [n for n in names if n.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]][:3]
            hint = f" (modules of that name: {', '.join(close)})" if close else ""
            raise ConfigurationError(
                f"tensor_parallel_plan: {pattern!r} matches no submodule of {type(module).__name__}{hint}. Names are "
                "as in named_modules(); '*' stands for one component.")
        for n in matched:
            if n in out and out[n] != style:
                raise ConfigurationError(f"tensor_parallel_plan: {n!r} is given two styles, {out[n]} and {style}.")
            out[n] = style
    return out


def apply_plan(module: nn.Module, plan: Mapping[str, str | Style], comm: Comm, sequence_parallel: bool,
               within: nn.Module | None = None) -> Applied:
    """Make ``module`` tensor-parallel over ``comm`` in place: every planned submodule replaced by (or turned into)
    its parallel form wherever it is held, its parameters cut to this rank's part. ``within``: only the submodules
    this other tree holds (a pipeline stage's, the plan still naming them as in ``module``), replaced in both trees."""
    styles = resolve(module, plan)
    scope = within if within is not None else module
    held = {id(m) for m in scope.modules()}
    name_of = {id(m): n for n, m in module.named_modules(remove_duplicate=False) if n}
    done = Applied(sequence_parallel=sequence_parallel)
    targets = {id(m): (n, m) for n, m in module.named_modules(remove_duplicate=False) if n in styles and id(m) in held}
    _check_heads(scope, {key: styles[n] for key, (n, _) in targets.items()}, name_of)
    if sequence_parallel and comm.active:
        _check_gathered(scope, {key: styles[n] for key, (n, _) in targets.items()}, name_of)
    replaced: dict[int, nn.Module] = {}
    for key, (name, mod) in sorted(targets.items(), key=lambda kv: (-kv[1][0].count("."), kv[1][0])):
        replaced[key] = styles[name].apply(name, mod, comm, sequence_parallel, done)
    _check_shared(scope, targets, done, name_of)
    for tree in {id(t): t for t in (module, scope)}.values():
        for parent in tree.modules():
            for child_name, child in list(parent.named_children()):
                if id(child) in replaced and replaced[id(child)] is not child:
                    setattr(parent, child_name, replaced[id(child)])
    for gathered in done.gathered:
        for layer in gathered.modules():
            if isinstance(layer, ColumnParallelLinear) and not layer.vocab:
                layer.input_whole = True
    return done


def _check_heads(module: nn.Module, styled: dict[int, Style], name_of: dict[int, str]) -> None:
    """A module holding a column-parallel layer and a head count not divided by the plan would reshape its slice of
    the heads with the whole model's count: fail at setup, naming the fix."""
    for mod in module.modules():
        children = [id(c) for c in mod.children()]
        if not any(isinstance(styled.get(c), Colwise) for c in children) or _has(styled.get(id(mod)), Heads):
            continue
        counts = Heads().counts(mod)
        if counts:
            name = name_of.get(id(mod), type(mod).__name__)
            listed = ", ".join(f"{c}={getattr(mod, c)}" for c in counts)
            raise ConfigurationError(
                f"{name} splits its projections over the tensor-parallel ranks but holds "
                f"{listed}: a forward that reshapes with it would give each rank's slice of the heads the whole "
                f'model\'s count. Add "{_generic(name)}": "heads" to tensor_parallel_plan(): trainkit then divides the '
                "counts by tp on every rank (harmless where the forward reshapes with -1 heads)."
            )


def _check_gathered(module: nn.Module, styled: dict[int, Style], name_of: dict[int, str]) -> None:
    """Under sequence parallelism a Hugging Face module holding column-parallel layers reshapes its output with its
    input's shape (a slice of the sequence): fail at setup naming the entry that gathers its input."""
    for mod in module.modules():
        if not type(mod).__module__.startswith("transformers.") or _has(styled.get(id(mod)), GatherSequence):
            continue
        if any(isinstance(styled.get(id(c)), Colwise) for c in mod.children()):
            name = name_of.get(id(mod), type(mod).__name__)
            raise ConfigurationError(
                f"{name} ({type(mod).__name__}, from transformers) reads the shape of its input, which under "
                "sequence parallelism is a slice of the sequence: add "
                f'"{_generic(name)}": "gather_sequence" to tensor_parallel_plan() (its input is then gathered '
                "whole once, at the module), or run with sequence_parallel=False."
            )


def _check_shared(module: nn.Module, targets: dict[int, tuple[str, nn.Module]], done: Applied,
                  name_of: dict[int, str]) -> None:
    """A layer outside the plan holding a parameter the plan split (a tied embedding) would compute with a slice as
    if it were whole: fail naming it."""
    for mod in module.modules():
        if id(mod) in targets:
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p in done.splits:
                name = name_of.get(id(mod), type(mod).__name__)
                raise ConfigurationError(
                    f"{name}.{pname} is shared with a layer tensor_parallel_plan() splits, but {name} is not in the "
                    f"plan, so it would compute with this rank's slice as if it were whole: add {_generic(name)!r} to "
                    "the plan (an nn.Embedding tied to the head: 'embedding')."
                )


def _generic(name: str) -> str:
    """``blocks.3.attn`` -> ``blocks.*.attn`` (the pattern a plan would use)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))
