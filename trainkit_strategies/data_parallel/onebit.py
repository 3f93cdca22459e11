"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed"): Adam for a warm-up, then frozen variance and sign-compressed momentum.

Adam's variance settles early in training; once it is frozen (§3), the update is linear in the momentum,
and the momentum tolerates 1-bit compression with error feedback (§4, Algorithm 1). After ``freeze_step``
steps each rank updates the momentum with its own, unreduced gradient, and the ranks average momenta with
``compressed_all_reduce``:

1. worker: add this rank's error; send each rank its chunk as signs plus one scale per chunk; keep
   what the signs lost as the new worker error (all-to-all);
2. server (every rank, for its chunk): average the W decompressed chunks, add its server error, compress
   again and keep what is lost as the server error;
3. every rank gathers the compressed chunks and decompresses them (all-gather).

Each rank moves (W-1)/W of n/8 bytes twice instead of (W-1)/W of 4n bytes twice for an fp32 all-reduce:
32x less volume, plus 4 bytes per chunk of scale. The scale of a chunk is its l2 norm over sqrt(numel),
so a decompressed chunk keeps the norm of what was compressed (as DeepSpeed's implementation does).

The error buffers differ between ranks and are meaningful only at the world size that made them: they are
saved as rank-local checkpoint state (``local_state``) and start from zero when a run resumes at another
world size. Momentum and variance stay the same on every rank and are checkpointed as Adam's are
(``exp_avg``, ``exp_avg_sq``, ``step``), so a run can move between AdamW and OneBitAdam.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from trainkit_strategies.capabilities import SelfReducing
from trainkit_strategies.communication.comm import Comm, Handle

# Eight 0/1 bytes read as one little-endian int64, times this constant, carry byte i to bit 63-i and nothing else
# to bits 56-63 (the partial products land on distinct bits, so nothing carries): the top byte is the packed byte.
_GATHER_BITS = 0x8040201008040201 - (1 << 64)
_TABLES: dict[torch.device, Tensor] = {}


def _sign_table(device: torch.device) -> Tensor:
    """Row b: the eight signs of byte b, most significant bit first (a set bit is -1)."""
    if device not in _TABLES:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(7, -1, -1)) & 1
        _TABLES[device] = (1 - bits * 2).float().to(device)
    return _TABLES[device]


_PASS = 1 << 20  # elements per pass of the codec: its temporaries stay small, reused and in cache


class Workspace:
    """The sign codec's scratch tensors, by name, allocated once and reused: a step's temporaries as large as
    the momentum, allocated afresh every step, cost more in first-touch page faults than the arithmetic done
    in them (on the 8.4M-parameter reference MLP: 24 ms against 5.5 for the server's sum of decompressed
    chunks). Each pass works on at most ``_PASS`` elements, so the scratch stays a few MB."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def tensors(self) -> list[Tensor]:
        return list(self._buffers.values())


def pack_signs(x: Tensor) -> Tensor:
    """The sign bits of ``x`` (set: negative, -0.0 included), 8 per byte, first element most significant;
    ``x.numel() % 8 == 0``."""
    return _pack(torch.signbit(x))


def _pack(negative: Tensor, out: Tensor | None = None, work: Workspace | None = None) -> Tensor:
    words = negative.reshape(-1).view(torch.uint8).view(torch.int64)
    if work is None or out is None:
        return ((words * _GATHER_BITS) >> 56).bitwise_and_(255).to(torch.uint8)
    product = torch.mul(words, _GATHER_BITS, out=work.get("words", words.numel(), torch.int64, words.device))
    return out.copy_(product.bitwise_right_shift_(56).bitwise_and_(255))


def unpack_signs(packed: Tensor, scale: Tensor | float = 1.0, out: Tensor | None = None,
                 work: Workspace | None = None) -> Tensor:
    """``scale`` times the +1/-1 of every bit in ``packed`` (one table lookup per byte), into ``out`` if given."""
    table = _sign_table(packed.device)
    if not (isinstance(scale, float) and scale == 1.0):
        table = table * scale
    if out is None:
        return torch.index_select(table, 0, packed.reshape(-1).int()).view(-1)
    packed, rows = packed.reshape(-1), out.view(-1, 8)
    for a in range(0, packed.numel(), _PASS // 8):
        b = min(packed.numel(), a + _PASS // 8)
        index = packed[a:b].int() if work is None else work.get("index", b - a, torch.int32, packed.device).copy_(
            packed[a:b])
        torch.index_select(table, 0, index, out=rows[a:b])
    return out


def compress(x: Tensor, chunks: int, error: Tensor | None = None,
             work: Workspace | None = None) -> tuple[Tensor, Tensor]:
    """``x`` viewed as ``chunks`` equal rows -> (per-row scale ||row||/sqrt(len), packed signs per row). With
    ``error`` (x's size), write what the signs lose there: ``x - scale * sign(x)``."""
    work = work if work is not None else Workspace()
    rows = x.view(chunks, -1)
    scales = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(rows.shape[1])
    signs = torch.empty((chunks, rows.shape[1] // 8), dtype=torch.uint8, device=x.device)
    errors = error.view(chunks, -1) if error is not None else None
    for r in range(chunks):
        for a in range(0, rows.shape[1], _PASS):
            b = min(rows.shape[1], a + _PASS)
            part = rows[r, a:b]
            if errors is not None:
                lost = errors[r, a:b]
                torch.copysign(scales[r], part, out=lost)  # a 0-dim scale is fast to broadcast
                torch.sub(part, lost, out=lost)
            negative = torch.signbit(part, out=work.get("negative", b - a, torch.bool, x.device))
            _pack(negative, signs[r, a // 8 : b // 8], work)
    return scales, signs


def decompress(scales: Tensor, signs: Tensor) -> Tensor:
    """Rows of ``scale * sign``, the inverse of ``compress`` up to the signs."""
    rows = torch.empty((scales.numel(), signs.shape[-1] * 8), device=signs.device)
    for row, scale, packed in zip(rows, scales, signs.view(scales.numel(), -1), strict=True):
        unpack_signs(packed, scale, out=row)
    return rows


def _decompress_sum(scales: Tensor, signs: Tensor, out: Tensor, work: Workspace | None = None) -> None:
    """``out`` = the sum over rows of ``scale * sign``, a pass of at most ``_PASS`` elements at a time."""
    work = work if work is not None else Workspace()
    signs = signs.view(scales.numel(), -1)
    unpack_signs(signs[0], scales[0], out=out, work=work)
    for scale, packed in zip(scales[1:], signs[1:], strict=True):
        for a in range(0, packed.numel(), _PASS // 8):
            b = min(packed.numel(), a + _PASS // 8)
            part = work.get("row", 8 * (b - a), torch.float32, out.device)
            out[8 * a : 8 * b].add_(unpack_signs(packed[a:b], scale, out=part, work=work))


def _wire(scales: Tensor, signs: Tensor) -> Tensor:
    """Scales (fp32 bytes) and signs of each row side by side in one uint8 buffer, a row per destination."""
    return torch.cat([scales.float().view(torch.uint8).view(-1, 4), signs], dim=1)


def _unwire(buffer: Tensor) -> tuple[Tensor, Tensor]:
    rows = buffer.view(-1, buffer.shape[-1])
    return rows[:, :4].contiguous().view(torch.float32).view(-1), rows[:, 4:]


def compressed_all_reduce(x: Tensor, worker_error: Tensor, server_error: Tensor, comm: Comm,
                          error_feedback: bool = True, work: Workspace | None = None) -> None:
    """Replace ``x`` (flat fp32, numel a multiple of 8·W) in place by the mean over ranks of every rank's ``x``,
    through sign compression with error feedback (Algorithm 1 of Tang et al.). ``worker_error`` has x's size,
    ``server_error`` one chunk's (numel/W); both are updated. ``error_feedback=False`` drops both errors
    (compression bias accumulates: for tests and ablations). ``work``: scratch kept between calls."""
    world = comm.world_size
    work = work if work is not None else Workspace()
    if error_feedback:
        x.add_(worker_error)
    scales, signs = compress(x, world, worker_error if error_feedback else None, work)
    sent = _wire(scales, signs)
    received = torch.empty_like(sent)
    comm.all_to_all(received.view(-1), sent.view(-1))
    their_scales, their_signs = _unwire(received)
    mine = work.get("server", server_error.numel(), torch.float32, x.device)
    _decompress_sum(their_scales / world, their_signs, mine, work)
    if error_feedback:
        mine.add_(server_error)
    scale, sign = compress(mine, 1, server_error if error_feedback else None, work)
    gathered = torch.empty((world, sent.shape[1]), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered.view(-1), _wire(scale, sign).view(-1))
    all_scales, all_signs = _unwire(gathered)
    for row, one_scale, packed in zip(x.view(world, -1), all_scales, all_signs, strict=True):
        unpack_signs(packed, one_scale, out=row, work=work)


class SignReduceScatter:
    """The reduce-scatter of ZeRO-1/2 in 1-bit form, for 1-bit Adam's compressed phase under a sharded optimizer.

    Under ZeRO a rank holds the momentum only of its own piece, so the momenta cannot be exchanged whole as
    under ddp. With the variance frozen the momentum is a linear filter of the gradients (§3 of the paper), so
    compressing what enters it keeps the error-feedback argument: each rank sends every owner its piece of
    (gradient + worker error) as signs and one scale, keeps what the signs lost, and the owner sums the W
    decompressed pieces into its gradient piece; its momentum then updates from that sum. There is no server
    error here because an owner never sends its piece back compressed: the updated parameters travel in ZeRO's
    all-gather as before. Per bucket, the rank keeps a worker error of the bucket's size (fp32).
    """

    def __init__(self, error_feedback: bool = True, work: Workspace | None = None) -> None:
        self.error_feedback = error_feedback
        self.errors: dict[int, Tensor] = {}
        self.work = work if work is not None else Workspace()

    def start(self, comm: Comm, out: Tensor, source: Tensor, key: int) -> tuple[Handle, Callable[[], None]]:
        """Launch the exchange of bucket ``key`` (``source``: its padded gradients) into ``out`` (this rank's
        piece, summed over ranks); the returned callable decompresses once the handle has been waited."""
        world = comm.world_size
        error = None
        if self.error_feedback:
            error = self.errors.get(key)
            if error is None or error.numel() != source.numel():
                error = self.errors[key] = torch.zeros(source.numel(), device=source.device)
            x = torch.add(error, source, out=self.work.get("x", source.numel(), torch.float32, source.device))
        else:
            x = source.float()
        scales, signs = compress(x, world, error, self.work)
        sent = _wire(scales, signs)
        received = torch.empty_like(sent)
        handle = comm.all_to_all(received.view(-1), sent.view(-1), async_op=True)

        def finish() -> None:
            their_scales, their_signs = _unwire(received)
            if out.dtype == torch.float32:
                _decompress_sum(their_scales, their_signs, out, self.work)
            else:
                total = self.work.get("total", out.numel(), torch.float32, out.device)
                _decompress_sum(their_scales, their_signs, total, self.work)
                out.copy_(total)

        return handle, finish


class OneBitAdam(Optimizer, SelfReducing):
    """AdamW for ``freeze_step`` steps, then 1-bit Adam: frozen variance, momentum averaged across data-parallel
    ranks in 1-bit compressed form with error feedback on the worker and the server side.

    Runs under ``ddp`` (which stops all-reducing gradients once compression starts: the momentum exchange
    replaces it; gradient clipping then uses the root mean square over ranks of each rank's local gradient
    norm, since the averaged gradient is never formed), under ``zero1``/``zero2`` (whose reduce-scatter turns
    1-bit: ``SignReduceScatter``) and ``single``.

    Args:
        params, lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        freeze_step: steps of full AdamW before the variance freezes and compression starts (the paper
            uses about 15-25% of training; longer than the run: plain AdamW throughout).
        error_feedback: keep the compression errors and add them back next step (off: for ablations;
            the compression bias then accumulates).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100,
                 error_feedback: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"OneBitAdam lr must be >= 0; got {lr}.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"OneBitAdam betas must lie in [0, 1); got {betas}.")
        if freeze_step < 1:
            raise ValueError(f"OneBitAdam freeze_step must be >= 1 (steps of full Adam first); got {freeze_step}.")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.freeze_step, self.error_feedback = freeze_step, error_feedback
        self.comm = Comm()
        self._worker_error: Tensor | None = None
        self._flat: Tensor | None = None  # every momentum, end to end (fp32 ones are views into it)
        self._server_error: Tensor | None = None
        self._denoms: dict[int, tuple] = {}  # per param group: (bias2_sqrt, eps, variances, their versions, denoms)
        self.workspace = Workspace()  # the codec's scratch (shared with a ZeRO strategy's SignReduceScatter)

    # -- SelfReducing ----------------------------------------------------------------------------------
    def bind(self, comm: Comm) -> None:
        self.comm = comm

    @property
    def reduces_gradients(self) -> bool:
        return self.steps_taken >= self.freeze_step

    @property
    def steps_taken(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                step = self.state.get(p, {}).get("step")
                if step is not None:
                    return int(step)
        return 0

    def local_state(self) -> dict[str, Tensor]:
        if self._worker_error is None or self._server_error is None:
            return {}
        return {"worker_error": self._worker_error, "server_error": self._server_error}

    def load_local_state(self, state: dict[str, Tensor]) -> None:
        self._worker_error, self._server_error = state.get("worker_error"), state.get("server_error")

    # -- the step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.reduces_gradients
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            for s in states:
                s["step"] += 1
            beta1, beta2 = group["betas"]
            grads = [p.grad for p in params]
            torch._foreach_lerp_([s["exp_avg"] for s in states], grads, 1 - beta1)
            if not compressing:
                torch._foreach_mul_([s["exp_avg_sq"] for s in states], beta2)
                torch._foreach_addcmul_([s["exp_avg_sq"] for s in states], grads, grads, value=1 - beta2)
            work.append((group, params, states))
        if compressing and self.comm.active and work:
            self._average_momenta([s for _, _, states in work for s in states])
        for group, params, states in work:
            step = int(states[0]["step"])
            self._update(group, params, states, step, min(step, self.freeze_step))
        return loss

    def _state_of(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, group: dict, params: list[Tensor], states: list[dict], step: int, variance_step: int) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        bias1 = 1 - group["betas"][0] ** step
        bias2_sqrt = math.sqrt(1 - group["betas"][1] ** variance_step)
        denoms = self._denominators(group, [s["exp_avg_sq"] for s in states], bias2_sqrt, eps,
                                    frozen=variance_step < step)
        torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denoms, value=-lr / bias1)

    def _denominators(self, group: dict, variances: list[Tensor], bias2_sqrt: float, eps: float,
                      frozen: bool) -> list[Tensor]:
        """sqrt(v) / bias2_sqrt + eps for every variance of ``group``. Once the variance is frozen they are the same
        step after step, so they are kept (three of the update's four passes over the parameters, the square root
        the slowest, are saved) for as long as the same variance tensors hold the same values (``_version``
        counts in-place changes; a load replaces them)."""
        versions = [v._version for v in variances]
        kept = self._denoms.pop(id(group), None)
        if kept is not None and kept[:2] == (bias2_sqrt, eps) and kept[3] == versions and all(
                a is b for a, b in zip(kept[2], variances, strict=True)):
            self._denoms[id(group)] = kept
            return kept[4]
        denoms = torch._foreach_sqrt(variances)
        torch._foreach_div_(denoms, bias2_sqrt)
        torch._foreach_add_(denoms, eps)
        if frozen:
            self._denoms[id(group)] = (bias2_sqrt, eps, variances, versions, denoms)
        return denoms

    def cached(self) -> list[Tensor]:
        return [d for kept in self._denoms.values() for d in kept[4]] + self.workspace.tensors()

    def load_state_dict(self, state_dict: dict) -> None:
        self._denoms.clear()
        super().load_state_dict(state_dict)

    def _average_momenta(self, states: list[dict]) -> None:
        """One compressed all-reduce over every momentum, as one flat buffer padded to 8·W elements. fp32 momenta
        become views into that buffer on first use (and again after a checkpoint load replaced them), so the
        exchange copies nothing; others are copied in and back."""
        world = self.comm.world_size
        momenta = [s["exp_avg"] for s in states]
        n = sum(m.numel() for m in momenta)
        padded = -(-n // (8 * world)) * 8 * world
        if self._flat is None or self._flat.numel() != padded:
            self._flat = torch.zeros(padded, dtype=torch.float32, device=momenta[0].device)
        flat = self._flat
        copied, offset = [], 0
        for state, m in zip(states, momenta, strict=True):
            view = flat[offset : offset + m.numel()]
            if m.data_ptr() != view.data_ptr():
                view.copy_(m.reshape(-1))
                if m.dtype == torch.float32 and m.is_contiguous():
                    state["exp_avg"] = view.view_as(m)
                else:
                    copied.append((m, view))
            offset += m.numel()
        flat[n:].zero_()  # padding: nothing of the previous exchange leaks into this one's scales
        if self._worker_error is None or self._worker_error.numel() != padded:
            self._worker_error = torch.zeros_like(flat)
            self._server_error = torch.zeros(padded // world, dtype=torch.float32, device=flat.device)
        assert self._server_error is not None
        compressed_all_reduce(flat, self._worker_error, self._server_error, self.comm, self.error_feedback,
                              self.workspace)
        for m, view in copied:
            m.copy_(view.view_as(m))
