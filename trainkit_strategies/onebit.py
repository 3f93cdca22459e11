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

from trainkit_strategies.base import SelfReducing
from trainkit_strategies.comm import Comm

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(x: Tensor) -> Tensor:
    """Bits of ``x >= 0`` (zero counts as +1), 8 per byte, most significant first; ``x.numel() % 8 == 0``."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """+1/-1 of every bit in ``packed``."""
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(-1).to(dtype).mul_(2).sub_(1)


def compress(x: Tensor, chunks: int) -> tuple[Tensor, Tensor]:
    """``x`` viewed as ``chunks`` equal rows -> (per-row scale ||row||/sqrt(len), packed signs per row)."""
    rows = x.view(chunks, -1)
    scales = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(rows.shape[1])
    return scales, pack_signs(rows).view(chunks, -1)


def decompress(scales: Tensor, signs: Tensor) -> Tensor:
    """Inverse of ``compress`` up to the signs: rows of ``scale * sign``."""
    return unpack_signs(signs.reshape(-1)).view(scales.numel(), -1).mul_(scales.unsqueeze(1))


def _wire(scales: Tensor, signs: Tensor) -> Tensor:
    """Scales (fp32 bytes) and signs of each row side by side in one uint8 buffer, a row per destination."""
    return torch.cat([scales.float().view(torch.uint8).view(-1, 4), signs], dim=1)


def _unwire(buffer: Tensor) -> tuple[Tensor, Tensor]:
    rows = buffer.view(-1, buffer.shape[-1])
    return rows[:, :4].contiguous().view(torch.float32).view(-1), rows[:, 4:]


def compressed_all_reduce(x: Tensor, worker_error: Tensor, server_error: Tensor, comm: Comm,
                          error_feedback: bool = True) -> None:
    """Replace ``x`` (flat fp32, numel a multiple of 8·W) in place by the mean over ranks of every rank's ``x``,
    through sign compression with error feedback (Algorithm 1 of Tang et al.). ``worker_error`` has x's size,
    ``server_error`` one chunk's (numel/W); both are updated. ``error_feedback=False`` drops both errors
    (compression bias accumulates: for tests and ablations)."""
    world = comm.world_size
    if error_feedback:
        x.add_(worker_error)
    scales, signs = compress(x, world)
    if error_feedback:
        torch.sub(x, decompress(scales, signs).view(-1), out=worker_error)
    sent = _wire(scales, signs)
    received = torch.empty_like(sent)
    comm.all_to_all(received.view(-1), sent.view(-1))
    their_scales, their_signs = _unwire(received)
    mine = decompress(their_scales, their_signs).mean(dim=0)
    if error_feedback:
        mine.add_(server_error)
    scale, sign = compress(mine, 1)
    if error_feedback:
        torch.sub(mine, decompress(scale, sign).view(-1), out=server_error)
    gathered = torch.empty((world, sent.shape[1]), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered.view(-1), _wire(scale, sign).view(-1))
    all_scales, all_signs = _unwire(gathered)
    x.copy_(decompress(all_scales, all_signs).view(-1))


class OneBitAdam(Optimizer, SelfReducing):
    """AdamW for ``freeze_step`` steps, then 1-bit Adam: frozen variance, momentum averaged across data-parallel
    ranks in 1-bit compressed form with error feedback on the worker and the server side.

    Runs under the ``ddp`` strategy (which stops all-reducing gradients once compression starts: the
    momentum exchange replaces it) and ``single``. Gradient clipping after the freeze uses the root mean
    square over ranks of each rank's local gradient norm (the averaged gradient is never formed).

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
        self._server_error: Tensor | None = None

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
            self._average_momenta([s["exp_avg"] for _, _, states in work for s in states])
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
        denoms = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_div_(denoms, bias2_sqrt)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denoms, value=-lr / bias1)

    def _average_momenta(self, momenta: list[Tensor]) -> None:
        """One compressed all-reduce over every momentum, flattened and padded to 8·W elements."""
        world = self.comm.world_size
        n = sum(m.numel() for m in momenta)
        padded = -(-n // (8 * world)) * 8 * world
        flat = torch.zeros(padded, dtype=torch.float32, device=momenta[0].device)
        torch.cat([m.reshape(-1).float() for m in momenta], out=flat[:n])
        if self._worker_error is None or self._worker_error.numel() != padded:
            self._worker_error = torch.zeros_like(flat)
            self._server_error = torch.zeros(padded // world, dtype=torch.float32, device=flat.device)
        assert self._server_error is not None
        compressed_all_reduce(flat, self._worker_error, self._server_error, self.comm, self.error_feedback)
        offset = 0
        for m in momenta:
            m.copy_(flat[offset : offset + m.numel()].view_as(m))
            offset += m.numel()
