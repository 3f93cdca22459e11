"""Synchronised batch normalisation: BatchNorm's batch statistics over the samples of every data-parallel rank.

``torch.nn.SyncBatchNorm`` calls ``torch.distributed`` itself and refuses CPU tensors (gloo), so trainkit has its own,
on ``Comm``: in training each layer sums, over the ranks, its per-channel sum and count (the mean), then the sum of
squared deviations from that mean (the variance; two passes, as one process computes it, rather than the sum of
squares, which cancels badly). The sums are autograd functions whose backward sums the gradients over the same ranks
(every rank's samples reach every rank's statistics), so the layer is exactly one BatchNorm over the global batch:
forward, backward and running statistics (updated with the unbiased global variance, as ``nn.BatchNorm`` does). In
eval mode it is a plain BatchNorm on its running statistics, with no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainkit_strategies.communication.comm import Comm


class _SumOverRanks(torch.autograd.Function):
    """``out = sum over ranks of tensor``; the gradient of each rank's input is the sum of every rank's gradient of
    ``out``."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        out = tensor.contiguous().clone()
        comm.all_reduce(out, "sum")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, "sum")
        return grad, None


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm (any of 1d/2d/3d: the input is ``N, C, *``) whose training statistics span ``comm``'s ranks.
    Its parameters and buffers are a BatchNorm's, under the same names, so checkpoints load into either."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, comm: Comm | None = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm if comm is not None else Comm()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the model, a pickle) normalises over its own batch: a communicator holds a
        process group, which cannot be copied."""
        return {**super().__getstate__(), "comm": Comm()}

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...); got {input.dim()}.")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        batch_stats = self.training or self.running_mean is None  # torch's rule: evaluation uses running statistics
        if not (batch_stats and self.training) or not self.comm.active:  # where they exist; only training syncs
            return super().forward(input)
        factor = 0.0
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        x = input.float()
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.full((1,), float(x.numel() // x.shape[1]), dtype=x.dtype, device=x.device)
        totals = _SumOverRanks.apply(torch.cat([x.sum(dims), count]), self.comm)
        n = totals[-1]
        mean = totals[:-1] / n
        centred = x - mean.view(shape)
        var = _SumOverRanks.apply(centred.square().sum(dims), self.comm) / n
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var.detach() * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype) * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype) * factor)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, comm: Comm) -> nn.Module:
    """``module`` with each BatchNorm layer (``nn.BatchNorm1d/2d/3d``, any ``_BatchNorm``) replaced by a
    ``SyncBatchNorm`` over ``comm`` holding the same parameters and buffers (the same tensors: an optimizer built
    before or after sees them), as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does. Returns the module (a new
    one when ``module`` itself is a BatchNorm)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        synced = SyncBatchNorm.__new__(SyncBatchNorm)
        nn.Module.__init__(synced)
        synced.__dict__.update(module.__dict__)
        synced.comm = comm
        return synced
    if isinstance(module, SyncBatchNorm):
        module.comm = comm
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, comm)
        if converted is not child:
            setattr(module, name, converted)
    return module

