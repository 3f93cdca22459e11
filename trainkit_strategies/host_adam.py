"""The host half of an offloaded step: torch's fused CPU Adam/AdamW, run in cache-sized chunks.

Under offload the gradients arrive in the compute dtype (bf16, say), the fp32 master weights and Adam
moments live in host memory, and the GPU wants its parameters back in the compute dtype. Converting the
whole gradient to fp32 first, stepping, then converting the whole master back costs two extra passes
over memory, which is what made the offloaded step slow: per chunk, the gradient is converted into a
small fp32 scratch that stays in cache, the fused kernel steps the chunk of master and moments, and the
chunk of the updated master is written out in the compute dtype while it is still in cache. Memory
traffic is then what the plain fused step moves (read 2 + 12 bytes, write 12 + 2 bytes a parameter),
the conversions ride along. The loss-scale undo, normalisation and clip factor reach the kernel as its
``grad_scale`` (it divides by it), so the gradient is never rewritten either.

The arithmetic is torch's own kernel on each chunk, so the result is bitwise the unchunked fused step's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch import Tensor
from torch.optim import Optimizer

CHUNK = 1 << 18  # elements: a 1 MiB fp32 scratch (fits L2 with the chunk of the master it meets)


def chunked_adam_supported(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is Adam or AdamW that torch's fused CPU kernel runs (the chunked path)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and not any(
        g.get("differentiable", False) for g in optimizer.param_groups)


def _decoupled(optimizer: Optimizer, group: dict) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _state(optimizer: Optimizer, group: dict, master: Tensor) -> dict:
    """The master's Adam state, created as torch's fused Adam creates it (so checkpoints do not care)."""
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        if group.get("amsgrad", False):
            state["max_exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


class ChunkedAdam:
    """Steps host master pieces of an Adam/AdamW optimizer from low-precision gradients, writing a
    low-precision copy of the result, chunk by chunk (see the module docstring).

    With ``workers > 1`` the chunks are shared among that many threads, each running torch's kernels on one
    core (intra-op threads are set to 1 for the step and restored after): a chunk's conversion, update and
    copy then stay in that core's cache, which measured faster than every kernel split across all cores.
    Only for a step nothing else computes during (not the delayed update, which overlaps the next step).
    """

    def __init__(self, optimizer: Optimizer, chunk: int = CHUNK, workers: int = 1) -> None:
        if not chunked_adam_supported(optimizer):
            raise TypeError(f"ChunkedAdam needs torch.optim.Adam or AdamW; got {type(optimizer).__name__}.")
        self.optimizer, self.chunk, self.workers = optimizer, chunk, max(1, workers)
        self._scratch: list[Tensor] = []
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="trainkit-host-adam") \
            if self.workers > 1 else None

    @torch.no_grad()
    def step(self, group: dict, master: Tensor, grad: Tensor, out: Tensor | None = None,
             mult: float | Tensor = 1.0) -> None:
        """One Adam(W) step of ``master`` (fp32, host) with ``grad * mult`` (any float dtype, host); then
        ``out`` (same numel) receives the updated master in its own dtype."""
        state = _state(self.optimizer, group, master)
        if master.is_meta:  # a strategy planned on the meta device (trainkit estimate): the state exists, no values
            return
        state["step"].add_(1)
        unscale = None
        if not (isinstance(mult, float | int) and mult == 1.0):
            unscale = (1.0 / torch.as_tensor(mult, dtype=torch.float32)).to("cpu").reshape(1)
        if out is not None and out.data_ptr() == master.data_ptr():
            out = None  # the master is its own working copy
        tensors = [master.view(-1), grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                   state["max_exp_avg_sq"].view(-1) if "max_exp_avg_sq" in state else None,
                   out.view(-1) if out is not None else None]
        ranges = [(lo, min(master.numel(), lo + self.chunk)) for lo in range(0, master.numel(), self.chunk)]
        workers = min(self.workers, len(ranges))
        while len(self._scratch) < workers:
            self._scratch.append(torch.empty(self.chunk, dtype=torch.float32, device="cpu"))
        run = partial(self._chunks, group, tensors, state["step"], unscale)
        if workers == 1 or self._pool is None:
            run(ranges, self._scratch[0])
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            list(self._pool.map(run, [ranges[w::workers] for w in range(workers)], self._scratch[:workers]))
        finally:
            torch.set_num_threads(threads)

    def _chunks(self, group: dict, tensors: list, step: Tensor, unscale: Tensor | None,
                ranges: list[tuple[int, int]], scratch: Tensor) -> None:
        master, grad, avg, avg_sq, maxes, out = tensors
        op = torch._fused_adamw_ if _decoupled(self.optimizer, group) else torch._fused_adam_
        beta1, beta2 = (float(b) for b in group["betas"])
        options = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=float(group["weight_decay"]),
                       eps=float(group["eps"]), amsgrad=maxes is not None, maximize=bool(group.get("maximize", False)),
                       grad_scale=unscale)
        for lo, hi in ranges:
            g = grad[lo:hi]
            if g.dtype != master.dtype:
                g = scratch[: hi - lo].copy_(g)  # converted in cache
            op([master[lo:hi]], [g], [avg[lo:hi]], [avg_sq[lo:hi]], [maxes[lo:hi]] if maxes is not None else [],
               [step], **options)
            if out is not None:
                out[lo:hi].copy_(master[lo:hi])  # written while the chunk is in cache
