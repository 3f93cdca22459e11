"""Logits split over the vocabulary, and a cross-entropy that never gathers them (Megatron-LM's vocabulary-parallel
cross-entropy: Shoeybi et al., 2019, §3, "fuse the output of the parallel GEMM with the cross entropy loss").

A vocabulary-parallel head returns its logits as a ``VocabShard``: a tensor holding this rank's columns of the
vocabulary that keeps being one through what a loss is usually written with (``float()``, ``flatten``, ``view``
and slices that leave the last dimension alone, ``contiguous``, ``detach``), and that ``F.cross_entropy`` computes
the loss of with three all-reduces of one number per position (the maximum, the sum of exponentials, the target's
logit) instead of gathering ``batch x sequence x vocabulary`` logits. Anything else (``argmax``, ``softmax``, a
``view`` that merges the vocabulary away) first gathers the whole logits, correctly and at that cost, and says so
once. The user's ``training_step`` stays as written for one process.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd import Function
from torch.utils._pytree import tree_leaves

from trainkit_strategies.communication.comm import Comm

_KEEP = {Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to, Tensor.type_as, Tensor.view,
         Tensor.reshape, Tensor.flatten, Tensor.contiguous, Tensor.detach, Tensor.__getitem__, Tensor.requires_grad_,
         torch.flatten, torch.reshape, Tensor.unflatten, Tensor.clone}
_METADATA = {"size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "get_device",
             "__len__", "data_ptr", "is_contiguous", "__format__", "__repr__", "register_hook", "backward",
             "retain_grad", "__hash__"}
_TRANSPOSES = {"T", "mT", "H", "mH"}
_warned = False


class VocabShard(Tensor):
    """This rank's vocabulary columns ``[lo, lo + shape[-1])`` of logits with ``vocab`` columns in all, split over
    the tensor-parallel group ``comm``."""

    _tp: tuple[Comm, int, int]

    @staticmethod
    def wrap(t: Tensor, comm: Comm, lo: int, vocab: int) -> Tensor:
        if not comm.active or isinstance(t, FakeTensor):
            return t  # traced with fake tensors (``trainkit estimate``): a loss on the shard saves the same bytes
        out = t.as_subclass(VocabShard)
        out._tp = (comm, lo, vocab)
        return out

    def gathered(self) -> Tensor:
        """The whole logits (an all-gather along the vocabulary; its backward keeps this rank's columns)."""
        from trainkit_strategies.tensor.regions import gather_last

        comm = self._tp[0]
        return gather_last(self.as_subclass(Tensor), comm)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        shard = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, VocabShard))
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        prop = getattr(getattr(func, "__self__", None), "__name__", "") if name == "__get__" else ""
        if name == "__get__" and prop not in _TRANSPOSES:  # .shape, .dtype, .grad, ... as they are
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return VocabShard.wrap(out, *shard._tp) if prop == "data" else out
        if func is F.cross_entropy:
            return _cross_entropy(shard, *args[1:], **kwargs)
        if func in _KEEP:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*_plain(args), **_plain(kwargs))
            if isinstance(out, Tensor) and out.dim() > 0 and out.shape[-1] == shard.shape[-1] and \
                    out.shape[-1] != 0 and _keeps_rows(shard, out, func):
                wrapped = out.as_subclass(VocabShard)
                wrapped._tp = shard._tp
                return wrapped
        _warn_gather(name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*_gathered(args), **_gathered(kwargs))


def _keeps_rows(shard: Tensor, out: Tensor, func: Any) -> bool:
    """A layout operation kept the vocabulary as the last dimension: as many rows of it as before (or, for a
    slice, no more), and a slice did not index into the vocabulary."""
    rows_before = shard.numel() // max(shard.shape[-1], 1)
    rows_after = out.numel() // max(out.shape[-1], 1)
    if func is Tensor.__getitem__:
        return rows_after <= rows_before
    return rows_after == rows_before


def _plain(obj: Any) -> Any:
    if isinstance(obj, VocabShard):
        return obj.as_subclass(Tensor)
    if isinstance(obj, tuple | list):
        return type(obj)(_plain(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _gathered(obj: Any) -> Any:
    if isinstance(obj, VocabShard):
        return obj.gathered()
    if isinstance(obj, tuple | list):
        return type(obj)(_gathered(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _gathered(v) for k, v in obj.items()}
    return obj


def _warn_gather(name: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"{name} on logits split over the vocabulary (tensor parallelism) gathered the whole logits first. "
            "F.cross_entropy computes the loss without gathering them, on the logits as they come (float(), "
            "flatten(0, 1) or view(-1, logits.size(-1)), slices of positions).", stacklevel=3,
        )


def _cross_entropy(logits: VocabShard, target: Tensor, weight: Tensor | None = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> Tensor:
    if weight is not None or size_average is not None or reduce is not None or logits.dim() != 2 or \
            target.dtype.is_floating_point:
        _warn_gather("cross_entropy with class weights, probabilities or classes on dimension 1 of a >2-d input")
        return F.cross_entropy(logits.gathered(), target, weight, size_average, ignore_index, reduce, reduction,
                               label_smoothing)
    comm, lo, vocab = logits._tp
    losses = _VocabParallelCrossEntropy.apply(logits.as_subclass(Tensor), target, lo, vocab, comm, ignore_index,
                                              label_smoothing)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction != "mean":
        raise ValueError(f"{reduction!r} is not a valid reduction; use 'mean', 'sum' or 'none'.")
    return losses.sum() / (target != ignore_index).sum()


class _VocabParallelCrossEntropy(Function):
    """Per-position losses ``log sum_v exp(z_v) - z_target`` (with label smoothing ``eps``: minus
    ``eps/V sum_v (z_v - log sum exp)`` plus ``eps z_target``...) over logits whose columns are split over ranks."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, lo: int, vocab: int, comm: Comm, ignore_index: int,
                smoothing: float) -> Tensor:
        z = logits.float()
        width = z.shape[-1]
        peak = z.detach().amax(-1)
        comm.all_reduce(peak, "max")
        z = z - peak.unsqueeze(-1)
        valid = target != ignore_index
        mine = valid & (target >= lo) & (target < lo + width)
        local = (target - lo).clamp(0, width - 1)
        exp = z.exp()
        sums = torch.stack([exp.sum(-1), torch.where(mine, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0),
                            z.sum(-1)])
        comm.all_reduce(sums)
        sum_exp, picked, total = sums[0], sums[1], sums[2]
        log_z = sum_exp.log()
        loss = log_z - picked  # -log p(target)
        if smoothing:
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - total / vocab)
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype = smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local, mine, valid = ctx.saved_tensors
        g = softmax  # saved for this backward only: updated in place
        onehot = torch.zeros_like(g).scatter_(-1, local.unsqueeze(-1), mine.unsqueeze(-1).to(g.dtype))
        g.sub_(onehot * (1.0 - ctx.smoothing))
        if ctx.smoothing:
            g.sub_(ctx.smoothing / ctx.vocab)
        g.mul_((grad * valid).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None, None, None
