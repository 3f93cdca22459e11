"""Tensor-parallel layers (Megatron-LM: Shoeybi et al., 2019, §3; sequence parallelism: Korthikanti et al., 2022).

Each layer adopts the parameters of the ``nn.Linear`` or ``nn.Embedding`` it replaces (the same ``Parameter``
objects, their data cut to this rank's part), so names, the user's optimizer and tied weights stay as they were.

A transformer block reads as the papers' equations: ``Y = GeLU(X A)`` with ``A`` split by columns
(``ColumnParallelLinear``: no communication in forward but entering the region), ``Z = Y B`` with ``B`` split by
rows (``RowParallelLinear``: one all-reduce, or under sequence parallelism one reduce-scatter, leaving it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.planning.memory import partial_products
from trainkit_strategies.tensor.loss import VocabShard
from trainkit_strategies.tensor.regions import (
    copy_in,
    reduce_out,
    scatter_seq,
    sequence_parallel_linear,
)


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel parameter is cut: dimension ``dim`` holds ``parts`` equal blocks (a fused q, k, v
    projection's three), and each block is split evenly over the ``ranks``; rank ``r`` holds the ``r``-th slice of
    every block."""

    dim: int
    ranks: int
    parts: int = 1

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        size = shape[self.dim]
        if size % (self.parts * self.ranks):
            what = f"{self.parts} blocks of {size // self.parts}" if self.parts > 1 else str(size)
            raise ConfigurationError(
                f"Tensor parallelism splits {name} (shape {tuple(shape)}) along dimension {self.dim} ({what}) over "
                f"tp={self.ranks} ranks, which does not divide it: use a tp that divides it, or a size that tp "
                f"divides (a vocabulary padded to a multiple of {self.ranks * 64}, say)."
            )

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[: self.dim], shape[self.dim] // self.ranks, *shape[self.dim + 1 :])

    def local(self, full: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s part of ``full``, as a tensor of its own."""
        return self.view(full, rank).clone()

    def view(self, full: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s part of ``full``, a view of it where one can be (one block, or a split of dimension 0)."""
        width = full.shape[self.dim] // self.parts // self.ranks
        if self.parts == 1:
            return full.narrow(self.dim, rank * width, width)
        blocks = full.unflatten(self.dim, (self.parts, -1))
        return blocks.narrow(self.dim + 1, rank * width, width).flatten(self.dim, self.dim + 1)

    def whole(self, locals_: list[Tensor]) -> Tensor:
        """The full tensor from every rank's part (in rank order)."""
        blocks = [t.unflatten(self.dim, (self.parts, -1)) for t in locals_]
        return torch.cat(blocks, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    def strides(self, shape: tuple[int, ...], rank: int) -> tuple[int, int, int]:
        """Where rank ``rank``'s part lies in the flattened full tensor of ``shape``: ``(origin, block, stride)``,
        element ``u`` of the flattened part being element ``(u // block) * stride + origin + u % block`` of the whole
        (the form checkpoints record, ``state.Strided``)."""
        inner = math.prod(shape[self.dim + 1 :])
        width = shape[self.dim] // self.parts // self.ranks
        return rank * width * inner, width * inner, shape[self.dim] // self.parts * inner


def _features(layer: nn.Module) -> tuple[int, int]:
    """``(in, out)`` features of an ``nn.Linear`` or of a Hugging Face ``Conv1D`` (weight ``[in, out]``)."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    return layer.nx, layer.nf


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s output features (and ``b``) split over the group: this rank computes its
    slice of ``Y``. The input is replicated (``copy_in``: all-reduce of its gradient in backward) or, under sequence
    parallelism, sharded along the sequence and gathered (``SequenceParallelLinear``). ``vocab``: the layer is a
    language-model head whose output is the vocabulary's logits, returned as a ``VocabShard``."""

    def __init__(self, linear: nn.Module, comm: Comm, sequence_parallel: bool, vocab: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.comm, self.sequence_parallel, self.vocab = comm, sequence_parallel, vocab
        self.in_features, self.out_features = _features(linear)  # the whole layer's
        self.transposed = not isinstance(linear, nn.Linear)  # a Conv1D (GPT-2) holds its weight as [in, out]
        # the module around it gathers the sequence at its input (``gather_sequence``): the input is whole here, and
        # its gradient is summed across the group by that gather's backward (a reduce-scatter)
        self.input_whole = False

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        if self.input_whole:
            y = F.linear(x, weight, self.bias)
        elif self.sequence_parallel and self.comm.active:
            y = sequence_parallel_linear(x, weight, self.bias, self.comm)
        else:
            y = F.linear(copy_in(x, self.comm), weight, self.bias)
        if self.vocab:
            return VocabShard.wrap(y, self.comm, self.comm.rank * weight.shape[0], self.out_features)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.weight.shape[0]}), tp={self.comm.world_size}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Z = Y B^T + b`` with ``B``'s input features split over the group (the input arrives split the same way,
    from a column-parallel layer): each rank's product is a partial sum, all-reduced (or, under sequence
    parallelism, reduce-scattered along the sequence) before the replicated bias is added once."""

    def __init__(self, linear: nn.Module, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.in_features, self.out_features = _features(linear)
        self.transposed = not isinstance(linear, nn.Linear)  # a Conv1D (GPT-2) holds its weight as [in, out]

    def forward(self, x: Tensor) -> Tensor:
        with partial_products():  # selective checkpointing recomputes it rather than keep s x b x h per rank
            partial = F.linear(x, self.weight.t() if self.transposed else self.weight)
        y = scatter_seq(partial, self.comm) if self.sequence_parallel else reduce_out(partial, self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), out_features={self.out_features}"
                f", tp={self.comm.world_size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group: a rank looks up the tokens in its range,
    zeros elsewhere, and the ranks' outputs are summed (all-reduce, or reduce-scatter along the sequence under
    sequence parallelism)."""

    def __init__(self, embedding: nn.Embedding, comm: Comm, sequence_parallel: bool,
                 split_after: bool = False) -> None:
        super().__init__()
        # ``split_after``: the output is summed whole and the sequence is split later (``split_sequence``), so the
        # gradient reaching it is this rank's slice only: summed across the group in backward
        self.split_after = split_after
        if embedding.max_norm is not None or embedding.sparse:
            raise ConfigurationError(
                "A vocabulary-parallel embedding cannot renormalise rows (max_norm) or give sparse "
                "gradients; drop those options, or keep the embedding out of the tensor-parallel plan.")
        self.weight = embedding.weight
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        rows = self.num_embeddings // comm.world_size
        self.lo, self.hi = comm.rank * rows, (comm.rank + 1) * rows
        pad = embedding.padding_idx
        self.padding_idx = pad - self.lo if pad is not None and self.lo <= pad < self.hi else None

    def forward(self, idx: Tensor) -> Tensor:
        if not self.comm.active:
            return F.embedding(idx, self.weight, self.padding_idx)
        outside = (idx < self.lo) | (idx >= self.hi)
        partial = F.embedding((idx - self.lo).masked_fill(outside, 0), self.weight, self.padding_idx)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_seq(partial, self.comm)
        out = reduce_out(partial, self.comm)
        return copy_in(out, self.comm) if self.split_after else out

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (this rank: rows {self.lo}-{self.hi}), "
                f"tp={self.comm.world_size}, sequence_parallel={self.sequence_parallel}")
