"""Data parallelism with bucketed, overlapped gradient all-reduce (Li et al., 2020, "PyTorch Distributed").

Every rank holds the whole model. Gradients live in flat buckets (about ``bucket_mb`` each, filled in
reverse parameter order, the order backward produces them) and each parameter's ``.grad`` is a view
into its bucket, so autograd accumulates straight into the buffer that is communicated. A
post-accumulate-grad hook counts each bucket down; when one is complete, and every bucket before
it has been launched, its all-reduce starts asynchronously while backward continues. Launching in
bucket order on every rank keeps the collectives matched. ``reduce_gradients`` waits for the buckets
and multiplies each once by the window's scale (1/N, item normalisation and loss-scale undo in one).

Accumulation micro-steps (``no_sync``) only accumulate; nothing is communicated until the window's
last backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.base import Strategy
from trainkit_strategies.comm import Handle
from trainkit_strategies.flat import OrderedLauncher, pack
from trainkit_strategies.precision import Precision


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: Tensor
    handle: Handle | None = None


@dataclass
class _Slot:
    bucket: int
    view: Tensor
    used: bool = False
    hooks: list = field(default_factory=list)


class DDPStrategy(Strategy):
    """Replicate the model; all-reduce gradients in overlapped buckets.

    Args:
        bucket_mb: gradient bucket size in MiB (smaller: earlier overlap, more collectives).
        find_unused_parameters: allow parameters that get no gradient in a step (their buckets are
            reduced at the end; a parameter unused on every rank keeps ``grad=None``, as it would in
            one process). Off: such a parameter is reported as an error naming it.
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) after every step.
    """

    name = "ddp"

    def __init__(self, bucket_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"ddp bucket_mb must be positive; got {bucket_mb}.")
        self.bucket_mb = bucket_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._buckets: list[_Bucket] = []
        self._slots: dict[nn.Parameter, _Slot] = {}
        self._names: dict[nn.Parameter, str] = {}
        self._launcher = OrderedLauncher([], self._launch)
        self._views_detached = False

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        super().setup(module, optimizer, precision)
        for slot in self._slots.values():
            for handle in slot.hooks:
                handle.remove()
        with torch.no_grad():
            self.comm.broadcast_coalesced([*module.parameters(), *module.buffers()])
        self._names = {p: n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        self._build_buckets(params)
        for p, slot in self._slots.items():
            slot.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _build_buckets(self, params: list[nn.Parameter]) -> None:
        groups = pack(list(reversed(params)), int(self.bucket_mb * 2**20), key=lambda p: p.dtype)
        self._buckets, self._slots = [], {}
        for index, group in enumerate(groups):
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=self.device)
            offset = 0
            for p in group:
                view = buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._slots[p] = _Slot(index, view)
                offset += p.numel()
            self._buckets.append(_Bucket(group, buffer))
        self._launcher = OrderedLauncher([len(g) for g in groups], self._launch)

    # -- backward and reduction ----------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        if self._syncing:
            self._launcher.reset()
        yield

    def _on_grad(self, param: Tensor) -> None:
        slot = self._slots[param]
        slot.used = True
        if param.grad is not slot.view and param.grad.data_ptr() != slot.view.data_ptr():
            slot.view.copy_(param.grad)  # someone replaced .grad (e.g. optimizer.zero_grad()): re-attach
            param.grad = slot.view
        if self._syncing:
            self._launcher.ready(slot.bucket)

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        bucket.handle = self.comm.all_reduce(bucket.buffer, async_op=True)

    def reduce_gradients(self, scale: float | Tensor) -> None:
        unused = [p for p, s in self._slots.items() if not s.used]
        if unused and not self.find_unused_parameters:
            names = ", ".join(self._names[p] for p in unused[:10])
            raise RuntimeError(
                f"ddp: {len(unused)} parameter(s) received no gradient in this step ({names}). If the model "
                "does not use every parameter in every step, pass find_unused_parameters=True "
                "(--trainer.strategy.find_unused_parameters true); otherwise make the loss depend on them."
            )
        self._launcher.flush()  # buckets whose hooks did not all fire (unused params, or a no_sync flush)
        globally_unused: list[nn.Parameter] = []
        if self.find_unused_parameters and self.comm.active:  # after every bucket: ranks launch in one order
            used = torch.tensor([s.used for s in self._slots.values()], dtype=torch.int32, device=self.device)
            self.comm.all_reduce(used)
            globally_unused = [p for p, u in zip(self._slots, used.tolist(), strict=True) if u == 0]
        elif self.find_unused_parameters:
            globally_unused = unused
        apply_scale = not (isinstance(scale, float | int) and scale == 1.0)
        for bucket in self._buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle = None
            if apply_scale:
                bucket.buffer.mul_(scale)
        for slot in self._slots.values():
            slot.used = False
        self._launcher.reset()
        for p in globally_unused:
            p.grad = None
            self._views_detached = True

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self.sync_buffers()

    def zero_grad(self) -> None:
        for bucket in self._buckets:
            bucket.buffer.zero_()
        if self._views_detached:
            for p, slot in self._slots.items():
                p.grad = slot.view
            self._views_detached = False

    def gradients(self) -> list[Tensor]:
        return [p.grad for p in self._slots if p.grad is not None]

    def teardown(self) -> None:
        for slot in self._slots.values():
            for handle in slot.hooks:
                handle.remove()
            slot.hooks.clear()
