"""One axis of ``strategy="parallel"``'s layout (tp, cp, ep, pp), as a transform of the model and what it adds to
each part of a step.

``ParallelStrategy`` holds its active axes in a fixed order (``parallel/strategy.py``, ``AXES``) and calls every hook
of ``Axis`` on each of them, in that order, in one loop per hook: transform the (possibly meta) model before the
data-parallel engine sees it, cut this rank's part of it (a pipeline's stage), take the parameters' names on, reduce
the gradients after the engine has, leave out of the norm what another rank counts and combine the norm over the
group, describe each parameter's part in checkpoints, and gather tensors whole. An axis is its folder (its
``transform.py``), one line in ``AXES``, and its tests.

What a layer needs at run time (its context-parallel group, where its experts are, its auxiliary-loss collector) is
installed on the module by the transform (``install``), and read by the layer itself or, for a function a user's
layer calls (``trainkit.parallel.attention``, ``positions``, ``add_auxiliary_loss``), from the nearest module on the
call stack (``installed``): nothing has to be entered around a forward, a backward, or a pipeline stage, and ranks
simulated as threads, each building its own module, keep apart.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Protocol

from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.base import Strategy
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.norms import combine_norm
from trainkit_strategies.state import pieces as st

_LOOKUP_FRAMES = 8  # frames above a function a layer calls searched for that layer (helpers, hooks in between)
_INSTALLED: set[str] = set()  # the names ever installed in this process: ``installed`` looks for no other


def install(module: nn.Module, name: str, value: Any) -> None:
    """Give ``module`` and every module inside it ``value`` as the plain attribute ``name`` (not a submodule, not
    state: ``state_dict`` and ``parameters()`` do not see it)."""
    for m in module.modules():
        m.__dict__[name] = value
    _INSTALLED.add(name)


def installed(name: str, default: Any = None) -> Any:
    """The attribute ``name`` of the module whose code called this (the nearest ``self`` that is a module, a few
    frames up: a function a layer calls, through helpers or a hook), or ``default`` where it has none or no module
    is found. A name no module was given costs one set lookup, and does not break a compiled graph (``torch.compile``
    cannot trace the walk up the frames: a layer that has its module at hand reads the attribute itself)."""
    if name not in _INSTALLED:
        return default
    frame = sys._getframe(1)
    for _ in range(_LOOKUP_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, nn.Module):
            return owner.__dict__.get(name, default)
        frame = frame.f_back
    return default


class Split(Protocol):
    """How an axis cuts a parameter (``tensor/layers.py``'s ``Split``)."""

    def strides(self, shape: tuple[int, ...], rank: int) -> tuple[int, int, int]: ...

    def whole(self, locals_: list[Tensor]) -> Tensor: ...


def gathered(t: Tensor, split: Split, comm: Comm) -> Tensor:
    """``t``, this rank's part of a tensor ``split`` over ``comm``, made whole (collective)."""
    t = t.contiguous()
    parts = t.new_empty((comm.world_size, *t.shape))
    comm.all_gather(parts.view(-1), t.view(-1))
    return split.whole(list(parts))


class Axis:
    """An axis of the layout: ``comm`` is its group. Every hook does nothing by default."""

    name = ""  # the mesh axis (``communication/layout.py``)
    acts_on_gradients = False  # changes gradients after the engine's reduction: the engine may not step in backward

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @classmethod
    def of(cls, layout: Any) -> Axis | None:
        """The axis for ``layout`` (a ``ParallelStrategy`` whose mesh is made), or None where it has none."""
        raise NotImplementedError

    def transform(self, module: nn.Module, device: Any) -> None:
        """Transform the whole (possibly meta) model before any engine sees it."""

    def local_module(self, module: nn.Module, optimizer: Optimizer | None, engine: Strategy,
                     whole_shape: Any, shapes: dict[str, tuple[int, ...]]) -> nn.Module:
        """The part of ``module`` this rank sets up (a pipeline's stage); ``module`` itself by default.
        ``whole_shape``: a parameter's shape before any axis cut it; ``shapes``: every tensor's, by name."""
        return module

    def bind(self, module: nn.Module, names: dict[Tensor, str], engine: Strategy,
             whole_shapes: dict[str, tuple[int, ...]]) -> None:
        """Take the parameters of ``module`` (this rank's part) on, by name, before ``engine`` sets it up."""

    def opened(self, module: nn.Module, engine: Strategy) -> None:
        """After the engine has set ``module`` up."""

    def local_batch(self, batch: Any) -> Any:
        return batch

    def reduce_gradients(self, engine: Strategy) -> None:
        """After ``engine`` has reduced the gradients over the data-parallel ranks."""

    def counted_elsewhere(self) -> list[Tensor]:
        """Parameters another rank of this axis counts in norms."""
        return []

    def combine_norm(self, norm: Tensor, norm_type: float) -> Tensor:
        return norm

    def state(self, layout: st.StateLayout, group_names: list[list[str]]) -> st.StateLayout:
        """The checkpoint layout with what this axis did to each tensor described."""
        return layout

    def whole(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` (by name) made whole across this axis (collective)."""
        return tensors

    def comms(self) -> list[Comm]:
        """Its communicators (the strategy's ``own_comms``, and ``comms_by_axis`` under ``name``)."""
        return [self.comm]

    def describe(self) -> str:
        return ""


class Dividing(Axis):
    """An axis that divides some parameters among its ranks and leaves the others whole on each (tensor
    parallelism's planned layers, expert parallelism's experts). The whole ones are kept apart by the engine, their
    gradients summed across the group where each rank saw other tokens (``sums``: one coalesced all-reduce per
    dtype), counted once in norms and written to checkpoints by the group's first rank; a divided one is recorded as
    its strided piece of the whole and gathered whole over the group."""

    acts_on_gradients = True

    def __init__(self, comm: Comm, sums: bool = True) -> None:
        super().__init__(comm)
        self.sums = sums
        self.splits: dict[Tensor, Split] = {}  # each divided parameter -> how (filled by ``transform``)
        self.split_of: dict[str, Split] = {}  # ... by the engine's parameter names
        self.strided: dict[str, st.Strided] = {}
        self.replicated: list[Tensor] = []

    def bind(self, module: nn.Module, names: dict[Tensor, str], engine: Strategy,
             whole_shapes: dict[str, tuple[int, ...]]) -> None:
        if not self.comm.active:
            return  # a group of one divides nothing and sums nothing
        self.split_of = {names[p]: split for p, split in self.splits.items() if p in names}
        self.strided = {n: st.Strided(*split.strides(whole_shapes[n], self.rank)) for n, split in self.split_of.items()}
        self.replicated = [p for p in module.parameters() if p not in self.splits]
        engine.keep_apart(self.replicated)  # summed across the group, counted once

    def reduce_gradients(self, engine: Strategy) -> None:
        if self.sums and self.comm.active:
            self.comm.all_reduce_coalesced(engine.gradients_of(self.replicated))

    def counted_elsewhere(self) -> list[Tensor]:
        return self.replicated if self.rank != 0 else []

    def combine_norm(self, norm: Tensor, norm_type: float) -> Tensor:
        return combine_norm(norm, norm_type, self.comm)

    def state(self, layout: st.StateLayout, group_names: list[list[str]]) -> st.StateLayout:
        def convert(holder: st.Holder) -> st.Holder:  # a part written by its rank, a whole one by the group's first
            segments = tuple(dataclasses.replace(s, strided=self.strided[s.name]) if s.name in self.strided else s
                             for s in holder.segments)
            divided = bool(segments) and all(s.name in self.split_of for s in segments)
            return st.Holder(holder.tensor, segments, holder.write and (divided or self.rank == 0))

        return dataclasses.replace(layout, model=[convert(h) for h in layout.model],
                                   optimizer_holders=[convert(h) for h in layout.optimizer_holders])

    def whole(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        if not self.comm.active or not self.split_of:
            return tensors
        return {name: gathered(t, self.split_of[name], self.comm) if name in self.split_of else t
                for name, t in tensors.items()}
