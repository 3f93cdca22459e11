"""Where a rank is among the ranks, and the collectives a Trainer uses for metrics and control flow (a part of
every ``Strategy``; no communication on one rank)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.environment import Environment


class Ranks:
    """This rank's place (``rank``, ``world_size``; ``dp_rank``/``dp_size``: what the sampler shards by) and the
    collectives for metrics: ``reduce``, ``all_gather``, ``all_gather_object``, ``broadcast_object``, ``barrier``."""

    env: Environment
    comm: Comm

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.env.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (what the sampler shards by)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def item_ranks(self) -> int:
        """Ranks whose micro-batches hold different items (the data-parallel ones; with context parallelism also
        the ranks holding other chunks of the same sequences): a plain loss's sample total is this many times a
        rank's when every rank's batches are as large."""
        return self.dp_size

    def data_comm(self) -> Comm:
        """The communicator over the ranks holding other samples than this one's (the data-parallel replicas, with
        context parallelism's ranks of other tokens): what batch statistics are summed over (``sync_batchnorm``)."""
        return self.comm

    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Reduce across ranks into a new tensor: "mean", "sum", "max" or "min"."""
        if not self.comm.active:
            return tensor
        out = tensor.detach().clone().to(self.device)
        self.comm.all_reduce(out, "sum" if op == "mean" else op)
        return out / self.world_size if op == "mean" else out

    def reduce_tokens(self, tensor: Tensor, op: str = "sum") -> Tensor | None:
        """Reduce across the ranks holding other tokens of this rank's samples (context parallelism's group), for
        values a module logs about its samples; None where no other rank holds any (no communication)."""
        return None

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Stack every rank's ``tensor`` (same shape on all ranks) along a new first dimension."""
        src = tensor.detach().contiguous().to(self.device)
        out = src.new_empty((self.world_size, *src.shape))
        self.comm.all_gather(out.view(-1), src.view(-1))
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.comm.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.comm.broadcast_object(obj, src)

    def barrier(self) -> None:
        self.comm.barrier()
