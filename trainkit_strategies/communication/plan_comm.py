"""A communicator for planning: every collective and point-to-point operation counted, none performed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainkit_strategies.communication.comm import DONE, Comm, CommStats, Handle


class PlanComm(Comm):
    """``world_size`` ranks as seen from ``rank``, with every collective and point-to-point operation counted and
    none performed: what ``trainkit estimate`` sets strategies up with on the meta device, so the bytes a plan reports
    for a step are the bytes the strategy's own code issues in one (padding, buffer broadcasts, compression and
    pipeline traffic included), not a formula. Receives leave their buffers as they are; object collectives answer
    with this rank's object."""

    def __init__(self, world_size: int, rank: int = 0, device: torch.device | None = None,
                 timeout_s: float = 1800.0) -> None:
        self.world_size, self.rank, self.group = world_size, rank, None
        self.ranks, self.timeout_s = list(range(world_size)), timeout_s
        self.device = device if device is not None else torch.device("cpu")
        self.stats, self.ring, self._tag = CommStats(), False, 0

    def subgroup(self, ranks: list[int], fresh: bool = False, control: bool = False) -> Comm:
        device = torch.device("cpu") if control else self.device
        mine = self.ranks[self.rank]
        if mine not in ranks or len(ranks) == 1:
            return PlanComm(1, 0, device, self.timeout_s)
        sub = PlanComm(len(ranks), ranks.index(mine), device, self.timeout_s)
        sub.ranks = list(ranks)  # global ranks, as a Comm's
        return sub

    def _run(self, fn: Any, *args: Any, async_op: bool = False, **kwargs: Any) -> Handle:
        return DONE

    def shift(self, send: Tensor, recv: Tensor, ring: list[int] | None = None) -> Handle:
        if (self.world_size if ring is None else len(ring)) > 1:
            self._count("send", send)
        return DONE

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Handle:
        self._count("send", tensor)
        return DONE

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Handle:
        self._count("recv", tensor)
        return DONE

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def abort(self, reason: str = "") -> None:
        pass
