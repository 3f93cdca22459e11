"""Data parallelism with bucketed, overlapped gradient all-reduce (Li et al., 2020, "PyTorch Distributed").

Every rank holds the whole model. Gradients live in flat buckets (about ``bucket_mb`` each, filled in
reverse parameter order, the order backward produces them) and each parameter's ``.grad`` is a view
into its bucket, so autograd accumulates straight into the buffer that is communicated. A
post-accumulate-grad hook counts each bucket down; when one is complete, and every bucket before
it has been launched, its all-reduce starts asynchronously while backward continues. Launching in
bucket order on every rank keeps the collectives matched. ``reduce_gradients`` waits for the buckets
and multiplies each once by the window's scale (1/N, item normalisation and loss-scale undo in one).

Accumulation micro-steps (``no_sync``) only accumulate; nothing is communicated until the window's
last backward. Buckets whose hooks did not all fire (parameters this rank left unused) are launched as that
backward ends, so every rank has issued every bucket's all-reduce, in bucket order, before anything else: a
parameter used on some ranks and not on others completes its bucket during backward on the former and at its end
on the latter, and the ranks' collectives still match.

Two ways to send fewer bytes, for runs bound by the network: ``compression="powersgd"`` sends each
bucket's gradient matrices as rank-r factors (``powersgd.py``), and an optimizer that averages across
ranks itself (``SelfReducing``: 1-bit Adam, ``onebit.py``) makes the buckets stay local once it does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import SelfReducing
from trainkit_strategies.communication.comm import Handle
from trainkit_strategies.communication.norms import combine_norm
from trainkit_strategies.data_parallel.powersgd import PowerSGD
from trainkit_strategies.init.materialise import RecordsInit
from trainkit_strategies.planning.memory import MemoryReport
from trainkit_strategies.precision import Precision
from trainkit_strategies.state.flat import OrderedLauncher, first_bucket_bytes, pack


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    numel: int
    buffer: Tensor | None = None  # allocated at the first backward (``_allocate``)
    handle: Handle | None = None


@dataclass
class _Slot:
    bucket: int
    view: Tensor | None = None  # the parameter's gradient in its bucket, once the bucket is allocated
    used: bool = False
    hooks: list = field(default_factory=list)


class DDPStrategy(RecordsInit, Strategy):
    """Replicate the model (built on meta, materialised whole straight on the device: ``RecordsInit``); all-reduce
    gradients in overlapped buckets.

    Args:
        bucket_mb: gradient bucket size in MiB (smaller: earlier overlap, more collectives).
        find_unused_parameters: allow parameters that get no gradient in a step (their buckets are
            reduced at the end; a parameter unused on every rank keeps ``grad=None``, as it would in
            one process). Off: such a parameter is reported as an error naming it.
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) after every step.
        compression: "powersgd": send gradient matrices as rank-``powersgd_rank`` factors with error feedback
            (Vogels et al., 2019) after ``powersgd_warmup_steps`` uncompressed optimizer steps. "none": exact.
        powersgd_rank: the factors' rank r; a matrix of n x m sends r(n+m) numbers instead of nm.
        powersgd_warmup_steps: optimizer steps all-reduced uncompressed before compression starts.
    """

    name = "ddp"
    accepts_self_reducing = True

    def __init__(self, bucket_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, compression: Literal["none", "powersgd"] = "none",
                 powersgd_rank: int = 1, powersgd_warmup_steps: int = 100) -> None:
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"ddp bucket_mb must be positive; got {bucket_mb}.")
        if compression not in ("none", "powersgd"):
            raise ValueError(f"ddp compression must be 'none' or 'powersgd'; got {compression!r}.")
        self.compressor = PowerSGD(powersgd_rank, powersgd_warmup_steps) if compression == "powersgd" else None
        self._local = False  # this window's gradients stay on their rank (a SelfReducing optimizer averages)
        self.bucket_mb = bucket_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._buckets: list[_Bucket] = []
        self._slots: dict[nn.Parameter, _Slot] = {}
        self._names: dict[nn.Parameter, str] = {}
        self._frozen: list[nn.Parameter] = []  # the parameters without requires_grad (nor a bucket)
        self._launcher = OrderedLauncher([], self._launch)
        self._end_queued = False

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        super().setup(module, optimizer, precision)
        if isinstance(optimizer, SelfReducing):
            if self.compressor is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} compresses its own communication; it does not combine with ddp "
                    "compression='powersgd'. Choose one: drop --trainer.strategy.compression, or use AdamW."
                )
            optimizer.bind(self.comm)
        with torch.no_grad():  # a bucket at a time: a flat copy of the whole model would double setup's peak
            for group in pack([*module.parameters(), *module.buffers()], int(self.bucket_mb * 2**20),
                              key=lambda t: t.dtype):
                self.comm.broadcast_coalesced(group)
        self._names = {p: n for n, p in module.named_parameters()}
        self._rebucket()

    def _rebucket(self) -> None:
        """Buckets (and gradient hooks) for the parameters that train now. Called at setup and again at the first
        backward after a callback unfroze parameters (Lightning's ``BaseFinetuning``, with or without a new param
        group): a parameter left outside every bucket would step on its own rank's gradient. Every rank runs the same
        callbacks, so all re-bucket at the same backward, alike. A parameter frozen for a while keeps its bucket (as
        an unused one: ``toggle_optimizer``'s)."""
        if self.compressor is not None and self._slots:
            warnings.warn("ddp: the trainable parameters changed, so the gradient buckets are rebuilt and PowerSGD's "
                          "factors and error feedback start afresh.", stacklevel=2)
        for slot in self._slots.values():
            for handle in slot.hooks:
                handle.remove()
        self._frozen = [p for p in self._names if not p.requires_grad]
        self._build_buckets([p for p in self._names if p.requires_grad])
        self._arm()

    def _arm(self) -> None:
        """The gradient hooks on (after ``setup``, and again at the first backward after a ``teardown``)."""
        for p, slot in self._slots.items():
            if not slot.hooks:
                slot.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _build_buckets(self, params: list[nn.Parameter]) -> None:
        """The buckets' layout; their buffers come at the first backward (``_allocate``), so setup holds the
        parameters alone, as torch FSDP2 allocates gradients lazily (a 202M fp32 model: 808 MB less at setup)."""
        groups = pack(list(reversed(params)), int(self.bucket_mb * 2**20), key=lambda p: p.dtype,
                      first_bytes=first_bucket_bytes(self.env))
        self._buckets, self._slots = [], {}
        layouts = []  # per bucket, (offset, shape) of each parameter: what PowerSGD compresses
        for index, group in enumerate(groups):
            offset, layout = 0, []
            for p in group:
                self._slots[p] = _Slot(index)
                layout.append((offset, p.shape))
                offset += p.numel()
            self._buckets.append(_Bucket(group, offset))
            layouts.append(layout)
        self._launcher = OrderedLauncher([len(g) for g in groups], self._launch)
        if self.compressor is not None:
            self.compressor.build(layouts, self.device)

    def _allocate(self) -> None:
        """The buckets' buffers, and each parameter's ``.grad`` a view into its bucket (a gradient it has already
        is copied in)."""
        for bucket in self._buckets:
            if bucket.buffer is not None:
                continue
            bucket.buffer = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype, device=self.device)
            offset = 0
            for p in bucket.params:
                view = bucket.buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._slots[p].view = view
                offset += p.numel()

    # -- backward and reduction ----------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        self._local = isinstance(self.optimizer, SelfReducing) and self.optimizer.reduces_gradients
        if any(p.requires_grad for p in self._frozen):
            self._rebucket()
        self._allocate()
        self._arm()
        if self._syncing:
            self._launcher.reset()
        self._end_queued = False
        yield

    def _on_grad(self, param: Tensor) -> None:
        slot = self._slots[param]
        if self._buckets[slot.bucket].buffer is None:  # a backward outside ``backward_pass`` (a hand-driven one)
            self._allocate()
        slot.used = True
        if param.grad is not slot.view and param.grad.data_ptr() != slot.view.data_ptr():
            slot.view.copy_(param.grad)  # someone replaced .grad (e.g. optimizer.zero_grad()): re-attach
            param.grad = slot.view
        if self._syncing:
            if not self._end_queued:
                Variable._execution_engine.queue_callback(self._launcher.flush)
                self._end_queued = True
            self._launcher.ready(slot.bucket)

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        for p in bucket.params:  # no gradient this window: its part of the bucket holds an earlier one
            if not self._slots[p].used:
                self._slots[p].view.zero_()
        if self._local:
            return
        if self._compressing:
            self.compressor.launch(index, bucket.buffer)
            return
        bucket.handle = self.comm.all_reduce(bucket.buffer, async_op=True)

    @property
    def _compressing(self) -> bool:
        return self.compressor is not None and self.compressor.active and self.comm.active

    def reduce_gradients(self, scale: float | Tensor) -> None:
        self._allocate()  # a rank that ran no backward yet still reduces (zeros) with the others
        unused = [p for p, s in self._slots.items() if not s.used and p.requires_grad]  # not: frozen for now (a
        # toggled optimizer's); their part of the bucket is zeroed and reduced as an unused parameter's
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
        if self._local:
            scale = scale * self.world_size  # each rank's own estimate of the mean; the optimizer averages
        elif self._compressing:
            self.compressor.exchange([bucket.buffer for bucket in self._buckets], self.comm)
        if self.compressor is not None:
            self.compressor.steps += 1
        apply_scale = not (isinstance(scale, float | int) and scale == 1.0)
        for bucket in self._buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle = None
            if apply_scale:
                bucket.buffer.mul_(scale)
        unused_anywhere = set(globally_unused)
        for p, slot in self._slots.items():
            if not slot.used and p not in unused_anywhere:  # unused here, used elsewhere: the others' sum; frozen
                p.grad = slot.view if p.requires_grad else None  # for now (toggled off), left alone as single would
            slot.used = False
        self._launcher.reset()
        for p in globally_unused:
            p.grad = None

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        """While gradients stay local (a SelfReducing optimizer's compressed phase): the root mean (p-th power
        mean) over ranks of each rank's gradient norm, the same on every rank, so fp16 overflow skips and
        clipping decide alike everywhere."""
        norm = super().grad_norm(norm_type, exclude)
        return combine_norm(norm, norm_type, self.comm, mean=True) if self._local else norm

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self.sync_buffers()

    def local_state(self) -> dict[str, Tensor]:
        state = super().local_state()
        if self.compressor is not None:
            state |= {f"powersgd/{k}": v for k, v in self.compressor.state().items()}
        return state

    def load_local_state(self, state: dict[str, Tensor]) -> None:
        super().load_local_state(state)
        if self.compressor is None:
            return
        mine = {k[9:]: v for k, v in state.items() if k.startswith("powersgd/")}
        if mine and not self.compressor.load(mine):
            warnings.warn("The checkpoint's PowerSGD state was saved for another bucket layout (bucket_mb, "
                          "powersgd_rank or the model changed); compression restarts with its warm-up.", stacklevel=2)

    def zero_grad(self) -> None:
        """Every gradient to None, the buckets left as they are: the window's first backward copies each gradient
        into its bucket (``_on_grad``), 8 bytes an element, where zeroing the buckets and accumulating into them
        moved 16; a parameter that gets none is zeroed in its bucket before the bucket is reduced."""
        for p, slot in self._slots.items():
            p.grad = None
            slot.used = False  # within a window (manual optimization's zero_grad), what was had is dropped too

    def gradients(self) -> list[Tensor]:
        return [p.grad for p in self._slots if p.grad is not None]

    def memory_report(self) -> MemoryReport:
        """The gradients are the buckets, held between steps whether or not a ``.grad`` points into them."""
        report = super().memory_report()
        held = sum(b.numel * b.params[0].element_size() for b in self._buckets)
        return replace(report, device={**report.device, "grads": held})

    def teardown(self) -> None:
        """The gradient hooks off: a backward outside the strategy's sums nothing across ranks; the strategy's next
        ``backward`` puts them back."""
        for slot in self._slots.values():
            for handle in slot.hooks:
                handle.remove()
            slot.hooks.clear()
