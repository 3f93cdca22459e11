"""Master weights for sharded strategies: one optimizer tensor per bucket piece, on the device or host.

Every sharding strategy (ZeRO-1/2, ZeRO-3/FSDP) ends up with the same optimizer-side picture: for
each ``FlatBucket`` this rank owns one piece, and the user's optimizer steps a master copy of that piece
(fp32 under mixed precision). ``MasterShards`` allocates those pieces per optimizer param group, in one
flat tensor per group and place (host first under offload, then the device for the last ``1 - ratio`` of the
buckets), points the user's optimizer at them, hands them their gradients, and describes them for checkpoints.

Host pieces of an Adam/AdamW optimizer step in runs of adjacent pieces (``host_adam.py``): ``start_host_step``, then
``host_ready`` for each bucket whose gradient is in host memory (in bucket order, as backward delivers them, or
all at once), then ``finish_host_step``. Each run's compute-dtype result goes to the device right after it on a copy
stream, one bulk copy per bucket, written over the gradient it came from so that it needs no host buffer of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.communication.norms import sharded_norm
from trainkit_strategies.errors import groups_fixed
from trainkit_strategies.offload.host_adam import HostAdam, follows, supported
from trainkit_strategies.offload.hostcopy import CopyStream, host_buffer, synchronize
from trainkit_strategies.state import pieces as st
from trainkit_strategies.state.flat import FlatBucket

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class FixedGroups:
    """For the strategies whose buckets and master shards are planned at setup by the param groups and the trainable
    parameters (ZeRO-1/2, ZeRO-Offload, ZeRO-3, FSDP): a group added later (``add_param_group``) has no master
    pieces, and a parameter frozen at setup and unfrozen later has no bucket (its gradient would never be reduced nor
    stepped), so ``check_plan``, at every backward, refuses either, saying what can take it. (Freezing a parameter
    for a while, as Lightning's ``toggle_optimizer`` does, is no change of plan.) Mix in before Strategy; call
    ``record_plan`` at the end of setup."""

    name: str
    accepts_new_groups = False
    module: torch.nn.Module | None
    _frozen: list[tuple[str, Tensor]] = []  # the parameters without requires_grad at setup, by name

    def record_plan(self) -> None:
        assert self.module is not None
        self._frozen = [(n, p) for n, p in self.module.named_parameters() if not p.requires_grad]

    def refresh_groups(self) -> None:
        raise groups_fixed(self.name, "the optimizer has a param group it was not set up with (added with "
                                      "optimizer.add_param_group)")

    def check_plan(self) -> None:
        if self._groups_changed():  # type: ignore[attr-defined]
            self.refresh_groups()
        unfrozen = [n for n, p in self._frozen if p.requires_grad]
        if unfrozen:
            raise groups_fixed(self.name, f"{len(unfrozen)} parameter(s) frozen at setup have requires_grad again ("
                                          f"{', '.join(unfrozen[:5])}{', ...' if len(unfrozen) > 5 else ''})")


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


MIN_RUN = 1 << 22
"""Elements: adjacent small buckets (biases, norms) are stepped together until their run holds this many; a bucket
of at least this size steps alone, so that its parameters go back to the device while the next one steps."""


class MasterShards:
    """Master pieces for ``buckets`` (each with ``group`` set), laid out group by group.

    Args:
        buckets: every bucket, in a fixed order (backward's); ``bucket.shard_start`` is assigned here.
        groups: number of optimizer param groups.
        dtype: master dtype.
        env: where the strategy runs (its device, and where host memory is).
        offload: keep pieces in host memory (all but the last ``1 - ratio`` of each group's buckets, the ones backward
            produces last and forward needs first).
        grad_dtype: the dtype gradients reach the step in.
        host_grads: the gradients are in host memory already (ZeRO-Offload's partition); otherwise, where host memory
            is separate, host pieces get page-locked staging of ``grad_dtype`` they cross the bus into.
        low_dtype: the compute dtype. Where host memory is separate, the step writes each updated host piece in it over
            its gradient, and a bucket's piece crosses back in one bulk copy; only when the gradient is of another
            dtype does a host piece get a page-locked buffer of its own for that.
        threads: cores a host step uses (default: torch's intra-op threads).

    Master pieces and the optimizer's state never cross the bus, so they are ordinary host memory; only what crosses
    is page-locked, each buffer at its exact size (``hostcopy.host_buffer``).
    """

    def __init__(self, buckets: Sequence[FlatBucket], groups: int, dtype: torch.dtype, env: Environment,
                 offload: bool = False, ratio: float = 1.0, grad_dtype: torch.dtype | None = None,
                 low_dtype: torch.dtype | None = None, host_grads: bool = False, threads: int | None = None) -> None:
        self.buckets, self.offload, self.env, self.device, self.dtype = list(buckets), offload, env, env.device, dtype
        self.pieces: dict[int, Tensor] = {}
        self.on_host: set[int] = set()
        self.host_grad: dict[int, Tensor] = {}  # page-locked staging of gradients arriving from the device
        self.host_low: dict[int, Tensor] = {}  # page-locked compute-dtype copies, where the gradient's dtype differs
        self.flats: list[Tensor] = []  # every allocation, for memory reports
        self._host_flats: list[tuple[Tensor, int, list[tuple[Tensor, int]]]] = []  # (flat, group, [(piece, offset)])
        self._written: set[int] = set()  # buckets whose working copy the last step wrote in place
        self._landing: dict[int, object] = {}  # buckets whose working copy is on its way up: the copy's event
        self._staged: set[int] = set()  # buckets whose updated piece waits in ``host_low`` for ``write_low``
        self._defer = False  # steps write ``host_low`` and leave the working copies alone (``add_low_buffers``)
        self.adam: HostAdam | None = None
        self.threads = threads or torch.get_num_threads()  # cores a host step uses
        self._uploads = CopyStream(env.device) if offload and env.host_is_separate else None
        self._run: dict[int, list[tuple[FlatBucket, Tensor, Tensor | None, Tensor | None]]] = {}  # per flat, pending
        staged = offload and env.host_is_separate
        for g in range(groups):
            members = [b for b in self.buckets if b.group == g]
            total = sum(b.piece for b in members)
            budget, on_host, shard = ratio * total if offload else 0, [], 0
            for b in members:
                b.shard_start, shard = shard, shard + b.piece
                if offload and sum(v.piece for v in on_host) + b.piece <= budget:
                    on_host.append(b)
            on_device = [b for b in members if b not in on_host]
            for host, chosen in ((True, on_host), (False, on_device)):
                size = sum(b.piece for b in chosen)
                if not size:
                    continue
                flat = host_buffer(size, dtype, env) if host else torch.zeros(size, dtype=dtype, device=self.device)
                self.flats.append(flat)
                extra = {}
                if host and staged and not host_grads and grad_dtype is not None:
                    extra["grad"] = host_buffer(size, grad_dtype, env, pinned=True)
                if host and staged and low_dtype is not None and grad_dtype != low_dtype:
                    extra["low"] = host_buffer(size, low_dtype, env, pinned=True)
                offset, placed = 0, []
                for b in chosen:
                    self.pieces[b.index] = flat[offset : offset + b.piece]
                    placed.append((self.pieces[b.index], offset))
                    if host:
                        self.on_host.add(b.index)
                    if "grad" in extra:
                        self.host_grad[b.index] = extra["grad"][offset : offset + b.piece]
                    if "low" in extra:
                        self.host_low[b.index] = extra["low"][offset : offset + b.piece]
                    offset += b.piece
                if host:
                    self._host_flats.append((flat, g, placed))

    def __getitem__(self, bucket: FlatBucket) -> Tensor:
        return self.pieces[bucket.index]

    def add_low_buffers(self, dtype: torch.dtype) -> None:
        """Give host pieces compute-dtype buffers of their own and write steps there, for ``write_low`` to bring into
        the working copies later: a step running beside the forward (the delayed update) must not write the
        parameters that forward reads."""
        self._defer = True
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
        self.adam = HostAdam(optimizer, self._host_flats) if self.offload and supported(optimizer, self.dtype) else None

    def step(self, optimizer: Optimizer, grad_of: Callable[[FlatBucket], Tensor], scale: float | Tensor = 1.0,
             low_of: Callable[[FlatBucket], Tensor] | None = None) -> None:
        """Give every piece its reduced gradient times ``scale`` and step.

        Device pieces (and host pieces of an optimizer ``HostAdam`` does not run) get their gradient converted to the
        master dtype and go through ``optimizer.step()``. Host pieces step in runs (``host_ready``), each bucket's
        updated piece written into ``low_of(bucket)`` (its working copy, compute dtype): directly where host memory
        is the device's, else by one bulk copy per bucket right after its run.
        """
        grads: dict[int, Tensor] = {}
        crossed = False
        for b in self.buckets:
            grad = grad_of(b)
            if b.index in self.on_host and grad.device != self.env.host:
                grad, crossed = transfer(self.host_grad[b.index], grad), True  # one bulk copy per bucket
            grads[b.index] = grad
        if crossed:
            synchronize(self.device)  # the host reads what the copies wrote
        self.step_device(optimizer, grads, scale)
        if self.adam is None:
            return
        self.start_host_step(float(scale))  # a device scalar: the host waits for it once
        for b in self.buckets:
            if b.index in self.on_host:
                self.host_ready(b, grads[b.index], low_of(b) if low_of is not None else None)
        self.finish_host_step()

    def step_device(self, optimizer: Optimizer, grads: dict[int, Tensor], scale: float | Tensor) -> None:
        """``optimizer.step()`` over the pieces ``HostAdam`` does not step, given their gradients."""
        stepped = []
        for b in self.buckets:
            if b.index not in grads or (self.adam is not None and b.index in self.on_host):
                continue
            piece = self.pieces[b.index]
            piece.grad = grads[b.index].to(device=piece.device, dtype=piece.dtype)
            if not (isinstance(scale, float | int) and scale == 1.0):
                piece.grad.mul_(scale.to(piece.device) if isinstance(scale, Tensor) else scale)
            stepped.append(piece)
        if stepped:
            optimizer.step()  # pieces without a gradient (the host's) are left alone
            for piece in stepped:
                piece.grad = None

    # -- the host step, a run at a time ---------------------------------------------------------------
    def start_host_step(self, mult: float, threads: int | None = None) -> None:
        """Begin a host step: gradients are multiplied by ``mult``; each run uses ``threads`` cores."""
        assert self.adam is not None
        self.adam.begin(mult, threads or self.threads)
        self._run = {}

    def widen(self) -> None:
        """The runs still to come in this host step use ``threads`` cores (a step begun during backward left one)."""
        if self.adam is not None:
            self.adam.threads = self.threads

    def host_ready(self, bucket: FlatBucket, grad: Tensor, target: Tensor | None) -> None:
        """``bucket``'s gradient is in host memory (``grad``); its updated piece belongs in ``target``. It steps
        with the adjacent buckets ready before it once their run is long enough, or at ``finish_host_step``."""
        assert self.adam is not None
        index = bucket.index
        low = self.host_low.get(index)
        if low is None and target is not None and target.data_ptr() != self.pieces[index].data_ptr():
            low = grad if self.env.host_is_separate else target
        flat = id(self.adam.flat_of(self.pieces[index]))
        run = self._run.setdefault(flat, [])
        entry = (bucket, grad, low, target)
        if run and not _adjacent(run[-1], entry, self.pieces):
            self._step_run(run)
            run = self._run[flat] = []
        run.append(entry)
        if sum(e[0].piece for e in run) >= MIN_RUN:
            self._step_run(run)
            self._run[flat] = []

    def finish_host_step(self) -> None:
        """Step every run still waiting."""
        for run in self._run.values():
            if run:
                self._step_run(run)
        self._run = {}

    def _step_run(self, run: list[tuple[FlatBucket, Tensor, Tensor | None, Tensor | None]]) -> None:
        assert self.adam is not None
        lows = [e[2] for e in run]
        self.adam.step([self.pieces[e[0].index] for e in run], [e[1] for e in run],
                       None if any(low is None for low in lows) else lows)  # type: ignore[arg-type]
        for bucket, _, low, target in run:
            if low is None:
                continue
            if self._defer:
                self._staged.add(bucket.index)
            elif low is target:
                self._written.add(bucket.index)
            else:  # host memory apart from the device's: up the bus on the copy stream, while the next run steps
                assert self._uploads is not None and target is not None
                with self._uploads.side(after_current=False):
                    transfer(target, low)
                    self._landing[bucket.index] = self._uploads.mark()

    def write_low(self, bucket: FlatBucket, target: Tensor) -> None:
        """Put the piece of ``bucket`` into ``target`` (its working copy, compute dtype, where ``low_of`` of the
        step pointed): nothing when the step wrote it there; the current stream waits for it when the step sent it
        up; otherwise a conversion of the master where it lives, crossing the bus in the compute dtype (after loading
        a checkpoint, say)."""
        index = bucket.index
        if index in self._written or target.data_ptr() == self.pieces[index].data_ptr():
            self._written.discard(index)
            return
        if index in self._landing:
            CopyStream.wait(self._landing.pop(index))
            return
        if index in self._staged:
            self._staged.discard(index)
            low = self.host_low[index]
            transfer(target, low) if low.device != target.device else target.copy_(low)
            return
        piece = self.pieces[index]
        if piece.device == target.device:
            target.copy_(piece)
        else:
            transfer(target, piece.to(target.dtype))

    def adopt_state(self) -> None:
        """Gather optimizer state loaded from elsewhere into the host step's flats now (it would be at the next
        step), so that nothing is held twice in between."""
        if self.adam is None:
            return
        state = self.adam.optimizer.state
        for flat in self.adam.flats:
            if any(state.get(piece) for piece, _ in flat.pieces):  # a checkpoint without optimizer state leaves none
                self.adam.adopt(flat)

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


def _adjacent(last: tuple, entry: tuple, pieces: dict[int, Tensor]) -> bool:
    """Whether ``entry`` (bucket, gradient, output, target) continues the run ending with ``last`` in every array."""
    if (last[2] is None) != (entry[2] is None):
        return False
    return (follows(pieces[last[0].index], pieces[entry[0].index]) and follows(last[1], entry[1])
            and (last[2] is None or follows(last[2], entry[2])))
