"""The communication of tensor and sequence parallelism, as autograd functions over a ``Comm``.

Megatron-LM's four mappings between the replicated and the tensor-parallel regions (Shoeybi et al., 2019, §3,
the functions f and g) and their sequence-parallel twins (Korthikanti et al., 2022, §4.2.2, g and ḡ), each the
other's transpose in backward:

===================  =========================================  ==========================================
function             forward                                    backward
===================  =========================================  ==========================================
``copy_in``          identity (f)                               all-reduce
``reduce_out``       all-reduce (g)                             identity
``gather_seq``       all-gather along the sequence (g)          reduce-scatter along the sequence
``scatter_seq``      reduce-scatter along the sequence (ḡ)      all-gather along the sequence
``split_seq``        keep this rank's slice of the sequence     the slice's gradient in place, zeros
                                                                elsewhere (a partial sum, as every
                                                                replicated parameter's under sequence
                                                                parallelism)
``gather_last``      all-gather along the last dimension        keep this rank's slice
===================  =========================================  ==========================================

The sequence is dimension -2 of an activation (``[batch, sequence, features]``, or ``[sequence, features]``):
gathering and scattering there from batch-first tensors costs one copy each way, which keeps user models as they
are written (Megatron lays activations out sequence-first to avoid it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function

from trainkit_strategies.communication.comm import Comm


def _apply(function: type[Function], *args: Any) -> Any:
    return function.apply(*args)


def run_eagerly_under_compile() -> None:
    """Under ``torch.compile`` run these functions eagerly: the compiled graph breaks around each collective (the
    ``Comm`` counts its bytes in Python) without dynamo trying to trace it first. Called when compilation is asked
    for (``trainkit.transforms.compile_blocks``), so a run that does not compile never imports dynamo."""
    global _apply
    _apply = torch.compiler.disable(_apply, recursive=True)


def _owned(x: Tensor) -> Tensor:
    """``x`` contiguous, in memory of our own: reduce-scatter uses its input as scratch space."""
    y = x.contiguous()
    return y.clone() if y is x else y  # contiguous() returns x itself when it already is


def _seq_check(x: Tensor, n: int) -> None:
    if x.dim() < 2:
        raise ValueError(f"Sequence parallelism splits dimension -2 (the sequence) of activations; got a tensor of "
                         f"shape {tuple(x.shape)}.")
    if x.shape[-2] % n:
        raise ValueError(
            f"Sequence parallelism splits the sequence (dimension -2, {x.shape[-2]} positions, of an activation of "
            f"shape {tuple(x.shape)}) evenly over tp={n} ranks: use sequences whose length is a multiple of {n}, or "
            "sequence_parallel=False."
        )


def all_gather_seq(x: Tensor, comm: Comm) -> Tensor:
    """Every rank's ``x`` concatenated along dimension -2 (rank order)."""
    n = comm.world_size
    if n == 1:
        return x
    x = x.contiguous()
    buffer = x.new_empty((n, *x.shape))
    comm.all_gather(buffer.view(-1), x.view(-1))
    outer = x.shape[:-2]
    if not outer.numel() or outer.numel() == 1:
        return buffer.view(*outer, n * x.shape[-2], x.shape[-1])
    # [n, *outer, s, h] -> [*outer, n, s, h]
    return buffer.movedim(0, -3).reshape(*outer, n * x.shape[-2], x.shape[-1])


def reduce_scatter_seq(x: Tensor, comm: Comm) -> Tensor:
    """This rank's slice along dimension -2 of the sum of every rank's ``x``."""
    n = comm.world_size
    if n == 1:
        return x
    _seq_check(x, n)
    outer, s, h = x.shape[:-2], x.shape[-2] // n, x.shape[-1]
    chunks = _owned(x.reshape(*outer, n, s, h).movedim(-3, 0))  # [n, *outer, s, h], rank-major
    out = x.new_empty((*outer, s, h))
    comm.reduce_scatter(out.view(-1), chunks.view(-1))
    return out


def seq_slice(x: Tensor, comm: Comm) -> Tensor:
    _seq_check(x, comm.world_size)
    s = x.shape[-2] // comm.world_size
    return x.narrow(-2, comm.rank * s, s)


class _CopyIn(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = _owned(grad)
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceOut(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        out = _owned(x)
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherSeq(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return all_gather_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return reduce_scatter_seq(grad, ctx.comm), None


class _ScatterSeq(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return reduce_scatter_seq(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_seq(grad, ctx.comm), None


class _SplitSeq(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm, ctx.shape = comm, x.shape
        return seq_slice(x, comm).clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        full = grad.new_zeros(ctx.shape)
        seq_slice(full, ctx.comm).copy_(grad)
        return full, None


class _GatherLast(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm, ctx.width = comm, x.shape[-1]
        n = comm.world_size
        x = x.contiguous()
        buffer = x.new_empty((n, *x.shape))
        comm.all_gather(buffer.view(-1), x.view(-1))
        return buffer.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.narrow(-1, ctx.comm.rank * ctx.width, ctx.width).contiguous(), None


def copy_in(x: Tensor, comm: Comm) -> Tensor:
    """Enter the tensor-parallel region from a replicated input (Megatron's f)."""
    return _apply(_CopyIn, x, comm) if comm.active else x


def reduce_out(x: Tensor, comm: Comm) -> Tensor:
    """Leave the tensor-parallel region by summing the ranks' partial outputs (Megatron's g)."""
    return _apply(_ReduceOut, x, comm) if comm.active else x


def gather_seq(x: Tensor, comm: Comm) -> Tensor:
    """Enter the tensor-parallel region from a sequence-sharded input (Korthikanti's g)."""
    return _apply(_GatherSeq, x, comm) if comm.active else x


def scatter_seq(x: Tensor, comm: Comm) -> Tensor:
    """Leave the tensor-parallel region into the sequence-sharded one (Korthikanti's ḡ)."""
    return _apply(_ScatterSeq, x, comm) if comm.active else x


def split_seq(x: Tensor, comm: Comm) -> Tensor:
    """A replicated tensor's slice of the sequence (positions, say), for the sequence-sharded region."""
    return _apply(_SplitSeq, x, comm) if comm.active else x


class _GatherWhole(_GatherSeq):
    """``_GatherSeq``'s forward; the gradient arrives whole and alike on every rank, which keeps its slice."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return seq_slice(grad, ctx.comm).contiguous(), None


def gather_whole(x: Tensor, comm: Comm) -> Tensor:
    """Leave the sequence-sharded region for one that every rank computes whole and alike (its gradient arrives
    whole and equal on every rank: each keeps its slice)."""
    return _apply(_GatherWhole, x, comm) if comm.active else x


def gather_last(x: Tensor, comm: Comm) -> Tensor:
    """Every rank's ``x`` concatenated along the last dimension (vocabulary-split logits made whole)."""
    return _apply(_GatherLast, x, comm) if comm.active else x


def sequence_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, comm: Comm) -> Tensor:
    """``linear(all_gather_seq(x), weight, bias)``, saving only ``x`` (``SequenceParallelLinear``)."""
    return _apply(SequenceParallelLinear, x, weight, bias, comm)


class SequenceParallelLinear(Function):
    """``linear(all_gather_seq(x), weight, bias)`` that saves only this rank's slice of ``x`` for backward and
    gathers it again there (Korthikanti et al., 2022, §4.2.2: otherwise the gathered input, t times the slice, would
    be the largest activation a column-parallel layer keeps). Backward reduce-scatters the input's gradient.
    Under autocast the slice is cast (and gathered) in the autocast dtype, as the matmul would cast it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, comm: Comm) -> Tensor:
        device, ctx.input_dtype = x.device.type, x.dtype
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        if autocast:
            dtype = torch.get_autocast_dtype(device)
            x, w = x.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
        else:
            w, b = weight, bias
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, w)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            return torch.nn.functional.linear(all_gather_seq(x, comm), w, b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None, None]:
        x, w = ctx.saved_tensors
        grad = grad.to(w.dtype)
        total = all_gather_seq(x, ctx.comm)
        grad_input = reduce_scatter_seq(grad.matmul(w), ctx.comm)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat_grad.t().matmul(total.reshape(-1, total.shape[-1])).to(ctx.dtypes[0])
        grad_bias = flat_grad.sum(0).to(ctx.dtypes[1]) if ctx.has_bias else None
        return grad_input.to(ctx.input_dtype), grad_weight, grad_bias, None
