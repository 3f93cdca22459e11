"""Master weights for sharded strategies: one optimizer tensor per bucket piece, on the device or host.

Every sharding strategy (ZeRO-1/2, ZeRO-3/FSDP) ends up with the same optimizer-side picture: for
each ``FlatBucket`` this rank owns one piece, and the user's optimizer steps a master copy of that piece
(fp32 under mixed precision). ``MasterShards`` allocates those pieces per optimizer param group, in one
flat tensor per group and place (device first, then host under offload, split by ``ratio``), points
the user's optimizer at them, hands them their gradients, and describes them for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.base import sharded_norm
from trainkit_strategies.flat import FlatBucket

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class DeferredGradScale:
    """Gradient scaling for strategies whose gradient shards are kept in the compute dtype.

    Multiplying fp16 gradients by 1/(loss scale) in fp16 flushes small values to zero, so the factor
    (normalisation, loss-scale undo, clipping) is kept aside and applied in fp32 when the gradients are
    handed to the master weights; norms are taken in fp32 and multiplied by it. Mix in before Strategy.
    """

    _grad_mult: float | Tensor = 1.0

    def _scale_local_grads(self, factor: float | Tensor) -> None:
        self._grad_mult = self._grad_mult * factor

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        return sharded_norm(self.gradients(), norm_type, self.comm, self.device) * self._grad_mult

    def clip_grad_value(self, value: float) -> None:
        self._apply_grad_mult()
        super().clip_grad_value(value)  # type: ignore[misc]

    def _apply_grad_mult(self) -> None:
        mult, self._grad_mult = self._grad_mult, 1.0
        if not (isinstance(mult, float | int) and mult == 1.0):
            torch._foreach_mul_(self.gradients(), mult)

    def _take_grad_mult(self) -> float | Tensor:
        mult, self._grad_mult = self._grad_mult, 1.0
        return mult


class MasterShards:
    """Master pieces for ``buckets`` (each with ``group`` set), laid out group by group.

    Args:
        buckets: every bucket, in a fixed order; ``bucket.shard_start`` is assigned here.
        groups: number of optimizer param groups.
        dtype: master dtype. device: compute device.
        offload: keep pieces in host memory (all but the first ``1 - ratio`` of each group's shard).
        host_grads: keep a host gradient buffer in the master dtype (when gradients need converting).
    """

    def __init__(self, buckets: Sequence[FlatBucket], groups: int, dtype: torch.dtype, device: torch.device,
                 offload: bool = False, ratio: float = 1.0, host_grads: bool = False) -> None:
        self.buckets, self.offload = list(buckets), offload
        self.pieces: dict[int, Tensor] = {}
        self.on_host: set[int] = set()
        self.host_grad: dict[int, Tensor] = {}
        self.flats: list[Tensor] = []  # every allocation, for memory reports
        pin = offload and torch.cuda.is_available()
        for g in range(groups):
            members = [b for b in self.buckets if b.group == g]
            total = sum(b.piece for b in members)
            budget, on_device, shard = (1.0 - ratio) * total if offload else total, [], 0
            for b in members:
                b.shard_start, shard = shard, shard + b.piece
                if not offload or sum(v.piece for v in on_device) + b.piece <= budget:
                    on_device.append(b)
            on_host = [b for b in members if b not in on_device]
            for place, chosen in ((device, on_device), (torch.device("cpu"), on_host)):
                size = sum(b.piece for b in chosen)
                if not size:
                    continue
                host = place.type == "cpu" and offload
                flat = torch.zeros(size, dtype=dtype, device=place, pin_memory=pin and host)
                grads = torch.zeros(size, dtype=dtype, device=place, pin_memory=pin and host) \
                    if host and host_grads else None
                self.flats.append(flat)
                offset = 0
                for b in chosen:
                    self.pieces[b.index] = flat[offset : offset + b.piece]
                    if host:
                        self.on_host.add(b.index)
                    if grads is not None:
                        self.host_grad[b.index] = grads[offset : offset + b.piece]
                    offset += b.piece

    def __getitem__(self, bucket: FlatBucket) -> Tensor:
        return self.pieces[bucket.index]

    def retarget(self, optimizer: Optimizer) -> None:
        """Point each param group at its buckets' pieces (one tensor per bucket), keeping its hyperparameters;
        under offload, use torch's fused kernel (CPU and CUDA) where the optimizer has one."""
        optimizer.state.clear()
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [self.pieces[b.index] for b in self.buckets if b.group == g]
            if self.offload and isinstance(optimizer, _FUSED) and "fused" in group:
                group["fused"], group["foreach"] = True, False

    def step(self, optimizer: Optimizer, grad_of: Callable[[FlatBucket], Tensor], scale: float | Tensor = 1.0) -> None:
        """Give every piece its reduced gradient (moved, converted, then multiplied by ``scale``) and step."""
        copied_to_host = False
        for b in self.buckets:
            piece, grad = self.pieces[b.index], grad_of(b)
            host = self.host_grad.get(b.index)
            if host is not None:  # a persistent host buffer: a fresh host allocation costs more than the step
                piece.grad = host.copy_(grad, non_blocking=True)
                copied_to_host = copied_to_host or grad.device.type == "cuda"
            else:
                piece.grad = grad.to(device=piece.device, dtype=piece.dtype, non_blocking=True)
            if not (isinstance(scale, float | int) and scale == 1.0):
                piece.grad.mul_(scale.to(piece.device) if isinstance(scale, Tensor) else scale)
        if copied_to_host:
            torch.cuda.current_stream().synchronize()  # the host optimizer reads what the copies wrote
        optimizer.step()
        for piece in self.pieces.values():
            piece.grad = None

    def holders(self, rank: int, optimizer: Optimizer | None) -> tuple[list[st.Holder], list[st.Holder]]:
        """Holders of every piece (model state), and of the optimizer's params in its param-group order."""
        holder = {b.index: st.Holder(self.pieces[b.index], tuple(b.segments(rank)), True) for b in self.buckets}
        groups = len(optimizer.param_groups) if optimizer is not None else 0
        ordered = [holder[b.index] for g in range(groups) for b in self.buckets if b.group == g]
        return list(holder.values()), ordered

    def split(self, optimizer: Optimizer | None) -> dict[str, dict[str, list[Tensor]]]:
        """Master pieces and their optimizer state, as {"device": {...}, "host": {...}} for memory reports."""
        state = optimizer.state if optimizer is not None else {}
        out: dict[str, dict[str, list[Tensor]]] = {"device": {"master": [], "optimizer": [], "grads": []},
                                                   "host": {"master": [], "optimizer": [], "grads": []}}
        for index, piece in self.pieces.items():
            side = out["host" if index in self.on_host else "device"]
            side["master"].append(piece)
            side["optimizer"] += [t for t in state.get(piece, {}).values() if isinstance(t, Tensor)]
            if index in self.host_grad:
                side["grads"].append(self.host_grad[index])
        return out
