"""Sharding units: the module groups ZeRO-3 and FSDP gather together, and their flat buckets."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from trainkit_strategies.communication.comm import Handle
from trainkit_strategies.state.flat import FlatBucket


@dataclass(eq=False)
class ShardedBucket:
    """One unit's parameters of one optimizer param group: layout, gather buffer, piece, gradient shard."""

    layout: FlatBucket
    unit: Unit
    gathered: Tensor  # compute dtype, ``layout.padded`` elements while gathered, storage freed otherwise
    shard: Tensor  # this rank's piece in the compute dtype (the master itself when the dtypes agree)
    grad: Tensor | None = None  # this rank's gradient shard, in the reduce dtype (a view of one flat buffer)

    @property
    def index(self) -> int:
        return self.layout.index


@dataclass(eq=False)
class Unit:
    """Modules whose parameters are gathered together. The root unit has no modules (the strategy gathers
    it for the whole step); a persistent unit stays gathered."""

    index: int
    modules: list[nn.Module]
    buckets: list[ShardedBucket] = field(default_factory=list)
    root: bool = False
    persistent: bool = False
    gathered: bool = False
    handles: list[Handle] = field(default_factory=list)
    forward_calls: int = 0
    reduced_buckets: int = 0
    pending_grads: int = 0  # gradients still to arrive in this backward (no-sync micro-steps)


def assign_units(module: nn.Module, names: dict[Tensor, str], groups: list[list[nn.Module]],
                 is_persistent: Callable[[Tensor], bool]) -> tuple[list[Unit], dict[int, list[Tensor]]]:
    """The units of ``module`` (the root unit first, then one per entry of ``groups``, then the persistent
    unit), each parameter given to one: the innermost unit among its owners' common ancestors, or the
    persistent unit when ``is_persistent``. Returns the units that hold parameters, and each one's parameters."""
    unit_of_module: dict[nn.Module, int] = {}
    parent: dict[int, int] = {}

    def visit(mod: nn.Module, current: int) -> None:
        for index, members in enumerate(groups, start=1):
            if any(mod is m for m in members):
                parent.setdefault(index, current)
                current = index
                break
        unit_of_module[mod] = current
        for child in mod.children():
            visit(child, current)

    visit(module, 0)
    units = [Unit(0, [], root=True)] + [Unit(i, list(m)) for i, m in enumerate(groups, start=1)]

    def ancestors(index: int) -> list[int]:
        chain = [index]
        while chain[-1] != 0:
            chain.append(parent[chain[-1]])
        return chain

    owners: dict[Tensor, list[nn.Module]] = {}
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(p, []).append(mod)
    params_of: dict[int, list[Tensor]] = {u.index: [] for u in units}
    persistent: list[Tensor] = []
    for p in names:
        if is_persistent(p):
            persistent.append(p)
            continue
        chains = [ancestors(unit_of_module[m]) for m in owners[p]]
        common = next(u for u in chains[0] if all(u in c for c in chains))
        params_of[common].append(p)
    if persistent:
        units.append(Unit(len(units), [], persistent=True))
        params_of[units[-1].index] = persistent
    return [u for u in units if params_of[u.index]], params_of



class UnitOrder:
    """The order units ran in, forward and backward, the first time: later passes follow it to name the unit to
    prefetch next. ``deviated`` turns true once a pass ran them in another order (prefetching should stop then)."""

    def __init__(self) -> None:
        self.order: dict[str, list[int]] = {"forward": [], "backward": []}
        self.position = {"forward": 0, "backward": 0}
        self.recorded = {"forward": False, "backward": False}
        self.deviated = False

    def restart(self, phase: str) -> None:
        """A forward or a backward begins (after the first, whose order is then the record)."""
        self.recorded[phase] = self.recorded[phase] or bool(self.order[phase])
        self.position[phase] = 0

    def follow(self, phase: str, unit: int) -> int | None:
        """``unit`` runs next in ``phase``: record it (the first pass) or check it against the record; the unit that
        runs after it, when the record says."""
        order, pos = self.order[phase], self.position[phase]
        if not self.recorded[phase]:
            order.append(unit)
            return None
        self.position[phase] = pos + 1
        if pos >= len(order) or order[pos] != unit:
            self.deviated = True
            return None
        return order[pos + 1] if pos + 1 < len(order) else None


def repeated_layers(module: nn.Module) -> list[nn.Module]:
    """The outermost repeated layers: children of an nn.ModuleList / nn.Sequential of which two or more share a
    class (transformer blocks); the search does not descend into a chosen layer. ``fsdp``'s default units, and the
    blocks activation checkpointing and ``trainkit estimate`` take by default."""
    out: list[nn.Module] = []

    def visit(mod: nn.Module) -> None:
        children = list(mod.children())
        if isinstance(mod, nn.ModuleList | nn.Sequential):
            kinds = [type(c) for c in children]
            repeated = [c for c in children if kinds.count(type(c)) > 1 and any(True for _ in c.parameters())]
            if repeated:
                out.extend(repeated)
                children = [c for c in children if c not in repeated]
        for child in children:
            visit(child)

    visit(module)
    return out


def weakly(method: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
    """``method`` as a hook that holds its object weakly. A parameter's hooks are not followed by the garbage
    collector while autograd holds the parameter too, so a strategy that held its module and was held by a hook on
    one of its parameters would never be freed: a sharded module and its strategy dropped after ``fit`` stayed in
    memory, whole model state and all."""
    ref = weakref.WeakMethod(method)

    def hook(param: Tensor) -> None:
        target = ref()
        if target is not None:
            target(param)

    return hook


def on_first_grad(output: object, fn: Callable[[Tensor], None]) -> None:
    """Call ``fn`` once per backward, when the first gradient of ``output``'s tensors arrives: hooks on the tensors
    (as FSDP2's pre-backward), not a module's full backward pre-hook. That one hands the module's outputs (and inputs)
    on as views made by a custom Function, which an in-place op after the module may not modify
    (``nn.LeakyReLU(inplace=True)`` after a unit failed with "Output 0 of BackwardHookFunction is a view and is being
    modified inplace"); a tensor's hook stays with the value it was registered on when an in-place op follows, and
    still fires before the module's own backward."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
    if tensors:
        register_multi_grad_hook(tensors, fn, mode="any")
