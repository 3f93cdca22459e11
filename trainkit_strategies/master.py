"""Master weights for sharded strategies: one optimizer tensor per bucket piece, on the device or host.

Every sharding strategy (ZeRO-1/2, ZeRO-3/FSDP) ends up with the same optimizer-side picture: for
each ``FlatBucket`` this rank owns one piece, and the user's optimizer steps a master copy of that piece
(fp32 under mixed precision). ``MasterShards`` allocates those pieces per optimizer param group, in one
flat tensor per group and place (device first, then host under offload, split by ``ratio``), points
the user's optimizer at them, hands them their gradients, and describes them for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from trainkit_strategies import state as st
from trainkit_strategies.base import sharded_norm
from trainkit_strategies.environment import Environment
from trainkit_strategies.flat import FlatBucket
from trainkit_strategies.host_adam import ChunkedAdam, chunked_adam_supported
from trainkit_strategies.hostcopy import host_buffer, synchronize

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

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        return sharded_norm(self._counted(exclude), norm_type, self.comm, self.device) * self._grad_mult

    def _counted(self, exclude: Collection[Tensor]) -> list[Tensor]:
        if exclude:
            raise ValueError(f"{self.name} holds every gradient in one partition, so it cannot leave some parameters "
                             "out of the norm; use ddp or fsdp for this composition.")
        return self.gradients()  # type: ignore[attr-defined]

    def clip_grad_value(self, value: float) -> None:
        self._apply_grad_mult()
        super().clip_grad_value(value)  # type: ignore[misc]

    def _apply_grad_mult(self) -> None:
        mult, self._grad_mult = self._grad_mult, 1.0
        if isinstance(mult, float | int) and mult == 1.0:
            return
        places: dict[torch.device, list[Tensor]] = {}
        for g in self.gradients():  # offloaded shards live in host memory: the factor goes to them
            places.setdefault(g.device, []).append(g)
        for place, grads in places.items():
            torch._foreach_mul_(grads, mult.to(place) if isinstance(mult, Tensor) else mult)

    def _take_grad_mult(self) -> float | Tensor:
        mult, self._grad_mult = self._grad_mult, 1.0
        return mult


def transfer(dst: Tensor, src: Tensor) -> Tensor:
    """Every host<->device copy of an offloaded step goes through here: one bulk, non-blocking copy of a
    whole bucket's piece, never a dtype conversion across the bus (tests count these calls)."""
    if dst.dtype != src.dtype:
        raise TypeError(f"transfer copies without converting; got {src.dtype} into {dst.dtype}.")
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src, non_blocking=True)
    return dst


class MasterShards:
    """Master pieces for ``buckets`` (each with ``group`` set), laid out group by group.

    Args:
        buckets: every bucket, in a fixed order; ``bucket.shard_start`` is assigned here.
        groups: number of optimizer param groups.
        dtype: master dtype.
        env: where the strategy runs (its device, and where host memory is).
        offload: keep pieces in host memory (all but the first ``1 - ratio`` of each group's shard).
        grad_dtype: the dtype gradients reach the step in when they are on the device; where host memory is
            separate, host pieces get page-locked staging of that dtype (gradients cross the bus as they are and
            are converted on the host). None: the gradients are in host memory already (ZeRO-Offload's partition).
        low_dtype: the compute dtype; where host memory is separate, host pieces get page-locked buffers where the
            step writes the updated piece in it, for one bulk copy back per bucket.

    Master pieces and the optimizer's state never cross the bus, so they are ordinary host memory; only the two
    kinds of staging are page-locked, each at its exact size (``hostcopy.host_buffer``).
    """

    def __init__(self, buckets: Sequence[FlatBucket], groups: int, dtype: torch.dtype, env: Environment,
                 offload: bool = False, ratio: float = 1.0, grad_dtype: torch.dtype | None = None,
                 low_dtype: torch.dtype | None = None) -> None:
        self.buckets, self.offload, self.env, self.device = list(buckets), offload, env, env.device
        self.pieces: dict[int, Tensor] = {}
        self.on_host: set[int] = set()
        self.host_grad: dict[int, Tensor] = {}  # page-locked staging of gradients arriving from the device
        self.host_low: dict[int, Tensor] = {}  # page-locked compute-dtype copies of updated host pieces
        self.flats: list[Tensor] = []  # every allocation, for memory reports
        self._written: set[int] = set()  # buckets whose compute-dtype copy the last step wrote in place
        self._staged: set[int] = set()  # buckets whose page-locked compute-dtype copy the last step wrote
        self._chunked: ChunkedAdam | None = None
        self.host_workers = torch.get_num_threads()  # threads for the host step (1 when it overlaps compute)
        staged = offload and env.host_is_separate
        for g in range(groups):
            members = [b for b in self.buckets if b.group == g]
            total = sum(b.piece for b in members)
            budget, on_device, shard = (1.0 - ratio) * total if offload else total, [], 0
            for b in members:
                b.shard_start, shard = shard, shard + b.piece
                if not offload or sum(v.piece for v in on_device) + b.piece <= budget:
                    on_device.append(b)
            on_host = [b for b in members if b not in on_device]
            for host, chosen in ((False, on_device), (True, on_host)):
                size = sum(b.piece for b in chosen)
                if not size:
                    continue
                flat = host_buffer(size, dtype, env) if host else torch.zeros(size, dtype=dtype, device=self.device)
                self.flats.append(flat)
                extra = {}
                if host and staged:
                    for name, kind in (("grad", grad_dtype), ("low", low_dtype)):
                        if kind is not None:
                            extra[name] = host_buffer(size, kind, env, pinned=True)
                offset = 0
                for b in chosen:
                    self.pieces[b.index] = flat[offset : offset + b.piece]
                    if host:
                        self.on_host.add(b.index)
                    if "grad" in extra:
                        self.host_grad[b.index] = extra["grad"][offset : offset + b.piece]
                    if "low" in extra:
                        self.host_low[b.index] = extra["low"][offset : offset + b.piece]
                    offset += b.piece

    def __getitem__(self, bucket: FlatBucket) -> Tensor:
        return self.pieces[bucket.index]

    def add_low_buffers(self, dtype: torch.dtype) -> None:
        """Give host pieces compute-dtype buffers of their own if they have none: a step running beside the
        forward (the delayed update) must not write the working parameters that forward reads."""
        for index in self.on_host - self.host_low.keys():
            self.host_low[index] = host_buffer(self.pieces[index].numel(), dtype, self.env)

    def retarget(self, optimizer: Optimizer) -> None:
        """Point each param group at its buckets' pieces (one tensor per bucket), keeping its hyperparameters;
        under offload, use torch's fused kernel (CPU and CUDA) where the optimizer has one."""
        optimizer.state.clear()
        fusable = set(_get_fused_kernels_supported_devices())
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [self.pieces[b.index] for b in self.buckets if b.group == g]
            places = {p.device.type for p in group["params"]}
            if self.offload and isinstance(optimizer, _FUSED) and "fused" in group and places <= fusable:
                group["fused"], group["foreach"] = True, False
        self._chunked = ChunkedAdam(optimizer, workers=self.host_workers) \
            if self.offload and chunked_adam_supported(optimizer) else None

    def step(self, optimizer: Optimizer, grad_of: Callable[[FlatBucket], Tensor], scale: float | Tensor = 1.0,
             low_of: Callable[[FlatBucket], Tensor] | None = None) -> None:
        """Give every piece its reduced gradient times ``scale`` and step.

        Host pieces of an Adam/AdamW optimizer step chunk by chunk from their low-precision gradient
        (``host_adam.py``), writing the updated piece in the compute dtype where ``low_of(bucket)`` says (its
        working copy on a CPU device) or into a pinned buffer for ``write_low`` to copy to the GPU. Every other
        piece gets its gradient converted to the master dtype and goes through ``optimizer.step()``.
        """
        chunked = self._chunked if self.offload else None
        grads: dict[int, Tensor] = {}
        crossed = False
        for b in self.buckets:
            grad = grad_of(b)
            if b.index in self.on_host and grad.device != self.env.host:
                grad, crossed = transfer(self.host_grad[b.index], grad), True  # one bulk copy per bucket
            grads[b.index] = grad
        if crossed:
            synchronize(self.device)  # the host reads what the copies wrote
        stepped_by_torch = []
        for b in self.buckets:
            if chunked is not None and b.index in self.on_host:
                continue
            piece = self.pieces[b.index]
            piece.grad = grads[b.index].to(device=piece.device, dtype=piece.dtype)
            if not (isinstance(scale, float | int) and scale == 1.0):
                piece.grad.mul_(scale.to(piece.device) if isinstance(scale, Tensor) else scale)
            stepped_by_torch.append(piece)
        if stepped_by_torch:
            optimizer.step()  # pieces without a gradient (the chunked ones) are left alone
            for piece in stepped_by_torch:
                piece.grad = None
        if chunked is None:
            return
        for b in self.buckets:
            if b.index in self.on_host:
                out = self.host_low.get(b.index, low_of(b) if low_of is not None else None)
                chunked.step(optimizer.param_groups[b.group], self.pieces[b.index], grads[b.index], out, scale)
                if b.index in self.host_low:
                    self._staged.add(b.index)
                elif out is not None:
                    self._written.add(b.index)

    def write_low(self, bucket: FlatBucket, target: Tensor) -> None:
        """Put the piece of ``bucket`` into ``target`` (its working copy, compute dtype, where ``low_of`` of the
        step pointed): nothing when the step wrote it there; under offload on a GPU one bulk copy of the pinned
        low-precision piece (converted on the host first if the step did not write it, after loading a
        checkpoint say); otherwise a conversion of the master where it lives. The next step's host writes
        into the pinned piece wait for that step's gradients, which the GPU produces after this copy."""
        index = bucket.index
        if index in self._written or target.data_ptr() == self.pieces[index].data_ptr():
            self._written.discard(index)
            return
        low = self.host_low.get(index)
        if low is None:
            target.copy_(self.pieces[index])
            return
        if index not in self._staged:
            low.copy_(self.pieces[index])
        self._staged.discard(index)
        transfer(target, low)

    def holders(self, rank: int, optimizer: Optimizer | None) -> tuple[list[st.Holder], list[st.Holder]]:
        """Holders of every piece (model state), and of the optimizer's params in its param-group order."""
        holder = {b.index: st.Holder(self.pieces[b.index], tuple(b.segments(rank)), True) for b in self.buckets}
        groups = len(optimizer.param_groups) if optimizer is not None else 0
        ordered = [holder[b.index] for g in range(groups) for b in self.buckets if b.group == g]
        return list(holder.values()), ordered

    def split(self, optimizer: Optimizer | None) -> dict[str, dict[str, list[Tensor]]]:
        """Master pieces and their optimizer state, as {"device": {...}, "host": {...}} for memory reports."""
        state = optimizer.state if optimizer is not None else {}
        out: dict[str, dict[str, list[Tensor]]] = {
            side: {"params": [], "master": [], "optimizer": [], "grads": []} for side in ("device", "host")}
        for index, piece in self.pieces.items():
            side = out["host" if index in self.on_host else "device"]
            side["master"].append(piece)
            side["optimizer"] += [t for t in state.get(piece, {}).values() if isinstance(t, Tensor)]
            if index in self.host_grad:
                side["grads"].append(self.host_grad[index])
            if index in self.host_low:
                side["params"].append(self.host_low[index])
        return out
