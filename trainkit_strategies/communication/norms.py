"""Gradient norms over shards: each rank's part where it lives, then one scalar collective (zero padding changes
nothing), so a norm is the whole model's under any sharding."""

from __future__ import annotations

import torch
from torch import Tensor

from trainkit_strategies.communication.comm import Comm


def local_norm(grads: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """The norm of ``grads`` together, on ``device``: per place they live (offloaded shards are in host memory),
    one norm there, and only those scalars move."""
    if not grads:
        return torch.zeros((), device=device)
    places: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        places.setdefault(g.device, []).append(g)
    totals = []
    for place, group in places.items():
        norms = torch._foreach_norm(group, norm_type, dtype=torch.float32)  # fp16 norms overflow at 65504
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        totals.append(total if place == device else total.to(device))
    return totals[0] if len(totals) == 1 else torch.linalg.vector_norm(torch.stack(totals), norm_type)


def sharded_norm(shards: list[Tensor], norm_type: float, comm: Comm, device: torch.device) -> Tensor:
    """The norm of the concatenation of every rank's ``shards`` (zero padding does not change it)."""
    return combine_norm(local_norm(shards, norm_type, device), norm_type, comm)


def combine_norm(local: Tensor, norm_type: float, comm: Comm, mean: bool = False) -> Tensor:
    """The norm over the ranks of ``comm`` from each rank's norm ``local``: the p-th powers summed (averaged with
    ``mean``: the ranks hold copies, not parts), the largest for the inf-norm; one scalar collective."""
    if not comm.active:
        return local
    if norm_type == float("inf"):
        comm.all_reduce(local, "max")
        return local
    powered = local.pow(norm_type)
    comm.all_reduce(powered)
    return (powered / comm.world_size if mean else powered).pow(1.0 / norm_type)
