"""The layout of the ranks: named degrees of parallelism over the world, and each axis's communicators.

A ``Layout`` is the grid ``arange(world).view(pp, dp_replicate, dp_shard, ep, cp, tp)``: rank ``r``'s coordinate on an
axis is its index along that dimension. ``tp`` is innermost, so the ranks of one tensor-parallel group are
consecutive (one node, where its per-layer all-reduces are cheap); ``pp`` is outermost, so pipeline stages are
the groups that cross nodes (one point-to-point transfer per micro-batch). The same order as torchtitan's
``ParallelDims`` and Megatron-LM's ``tp-cp-dp-pp``, innermost first.

A ``Mesh`` is a layout over a communicator: the subgroup of every combination of axes a strategy asked for, made
once, in one order on every rank (``torch.distributed.new_group`` is collective over the whole world).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from trainkit_strategies.communication.comm import Comm

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism whose product is the world size.

    Attributes:
        pp: pipeline stages. dp_replicate: replicas of the model (gradients all-reduced across them).
        dp_shard: ranks a replica's parameters, gradients and optimizer state are sharded over (FSDP units);
            with ``dp_replicate`` > 1 as well this is HSDP. ep: expert parallelism (a mixture of experts' experts
            divided among ranks that read different batches: data-parallel ranks too). cp: context parallelism
            (slices of each sequence). tp: tensor parallelism (layers split across ranks; Megatron-LM).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) < 1]
        if bad:
            raise ValueError(f"Every degree of parallelism must be at least 1; got {', '.join(bad)}.")

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees().values())

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the batch: ranks reading different data (the expert-parallel ones among them)."""
        return self.dp_replicate * self.dp_shard * self.ep

    def __str__(self) -> str:
        parts = [f"{axis}={n}" for axis, n in self.degrees().items() if n > 1]
        return " x ".join(parts) or "one rank"

    def check(self, world_size: int, ranks_per_node: int | None = None, tp_across_nodes: bool = False) -> None:
        """Fail, naming the numbers that disagree, unless the degrees multiply to ``world_size`` and (unless
        ``tp_across_nodes``) a tensor-parallel group fits within a node of ``ranks_per_node`` ranks."""
        product = " x ".join(f"{axis}={n}" for axis, n in self.degrees().items())
        if self.world_size != world_size:
            raise ValueError(f"The layout {product} holds {self.world_size} ranks, but the world has {world_size}: "
                             "choose degrees whose product is the number of ranks (--trainer.devices x nodes).")
        if ranks_per_node and not tp_across_nodes and self.tp > 1 and ranks_per_node % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide the {ranks_per_node} ranks of a node, so a tensor-parallel group would "
                "span nodes, and its all-reduces (several per layer) would cross the network: use a tp that divides "
                f"{ranks_per_node}, or pass tp_across_nodes=True if that is what you want."
            )

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every axis."""
        out, rest = {}, rank
        for axis in reversed(AXES):
            n = getattr(self, axis)
            out[axis], rest = rest % n, rest // n
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * getattr(self, axis) + coords.get(axis, 0)
        return rank

    def group(self, rank: int, axes: Sequence[str]) -> list[int]:
        """The ranks that share ``rank``'s coordinates on every axis but ``axes``, in grid order."""
        return next(g for g in self.groups(axes) if rank in g)

    def groups(self, axes: Sequence[str]) -> list[list[int]]:
        """Every group along ``axes`` (ranks varying only in those coordinates), in one fixed order."""
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"Unknown axes {unknown}; the axes are {', '.join(AXES)}.")
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            by_rest.setdefault(tuple(c[a] for a in AXES if a not in axes), []).append(rank)
        return list(by_rest.values())


class Mesh:
    """A layout over ``comm`` (the world's communicator, or a sub-world's whose ranks the layout numbers): one
    communicator per requested combination of axes, made at once on every rank.

    ``comm(axes)`` is this rank's group along ``axes``; axes of degree 1 drop out, and a group of one rank is a
    communicator that does nothing (collectives return at once), so code needs no special case for them.
    """

    def __init__(self, layout: Layout, comm: Comm, axes: Iterable[Sequence[str]]) -> None:
        if comm.world_size != layout.world_size:
            raise ValueError(f"A mesh of {layout} needs {layout.world_size} ranks; its communicator has "
                             f"{comm.world_size}.")
        self.layout, self.world = layout, comm
        self.coords = layout.coords(comm.rank)
        self._comms: dict[tuple[str, ...], Comm] = {}
        for wanted in axes:
            key = self._key(wanted)
            if key in self._comms:
                continue
            mine = Comm(timeout_s=comm.timeout_s, device=comm.device) if not key else None
            for members in (layout.groups(key) if key else []):
                made = comm.subgroup([comm.ranks[r] for r in members]) if len(members) < comm.world_size else comm
                if comm.rank in members:
                    mine = made
            assert mine is not None
            self._comms[key] = mine

    def _key(self, axes: Sequence[str]) -> tuple[str, ...]:
        return tuple(a for a in AXES if a in axes and getattr(self.layout, a) > 1)

    def comm(self, axes: Sequence[str] | str) -> Comm:
        key = self._key((axes,) if isinstance(axes, str) else axes)
        if key not in self._comms:
            raise KeyError(f"The mesh was not built with a group along {key}; add it to the axes it is made with.")
        return self._comms[key]


def check_degrees(**degrees: int | None) -> None:
    bad = [f"{k}={v}" for k, v in degrees.items() if v is not None and (not isinstance(v, int) or v < 1)]
    if bad:
        raise ValueError(f"parallel: every degree must be a whole number of at least 1; got {', '.join(bad)}.")


def resolve_layout(world_size: int, ranks_per_node: int, tp_across_nodes: bool, pp: int, tp: int, dp_replicate: int,
                   dp_shard: int | None, cp: int = 1, ep: int = 1) -> Layout:
    """The layout of these degrees at ``world_size`` (``dp_shard`` None: what the others leave), checked."""
    if dp_shard is None:
        rest = pp * tp * dp_replicate * cp * ep
        if world_size % rest:
            raise ValueError(f"parallel: pp={pp} x tp={tp} x cp={cp} x ep={ep} x dp_replicate={dp_replicate} = {rest} "
                             f"does not divide the {world_size} ranks; choose degrees whose product divides the world "
                             "(dp_shard takes what is left).")
        dp_shard = world_size // rest
    layout = Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
    layout.check(world_size, ranks_per_node or None, tp_across_nodes)
    return layout
