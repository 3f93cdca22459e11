"""A synthetic corpus whose best possible loss is known exactly.

Tokens come from a fixed random order-2 Markov chain: ``P(x_t | x_{t-2}, x_{t-1})`` is a Dirichlet draw
per context. The chain's entropy rate

    H = sum_{a,b} pi(a, b) * H(P(. | a, b))

(``pi`` the stationary distribution over consecutive pairs) is the lowest cross-entropy any model can
reach on a token whose two predecessors it sees, so "validation loss minus H" measures, in nats, how
much the model has left to learn.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trainkit.data import DataModule, check_batch_size
from trainkit.work import tracked


class MarkovChain:
    """An order-2 chain over ``vocab_size`` tokens, drawn from ``seed`` (Dirichlet(``alpha``) rows)."""

    def __init__(self, vocab_size: int = 16, alpha: float = 0.5, seed: int = 1234) -> None:
        if vocab_size < 2 or alpha <= 0:
            raise ValueError(f"MarkovChain needs vocab_size >= 2 and alpha > 0; got {vocab_size}, {alpha}.")
        self.vocab_size = vocab_size
        rows = np.random.default_rng(seed).dirichlet([alpha] * vocab_size, size=(vocab_size, vocab_size))
        self.transition = torch.from_numpy(rows)  # [a, b, c] = P(c | a, b), float64
        self.pair_stationary = self._stationary()

    def _stationary(self, iters: int = 10_000, tol: float = 1e-15) -> Tensor:
        v = self.vocab_size
        pi = torch.full((v, v), 1.0 / v**2, dtype=torch.float64, device="cpu")
        for _ in range(iters):
            nxt = torch.einsum("ab,abc->bc", pi, self.transition)
            if (nxt - pi).abs().max() < tol:
                return nxt
            pi = nxt
        return pi

    @property
    def entropy_rate(self) -> float:
        """H in nats per token."""
        p = self.transition
        row_entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
        return float((self.pair_stationary * row_entropy).sum())

    def sample(self, num_sequences: int, length: int, seed: int) -> Tensor:
        """``num_sequences`` independent stationary runs of ``length`` tokens (int64)."""
        gen = torch.Generator().manual_seed(seed)
        v = self.vocab_size
        pairs = torch.multinomial(self.pair_stationary.flatten(), num_sequences, replacement=True, generator=gen)
        out = torch.empty(num_sequences, length, dtype=torch.long, device="cpu")
        out[:, 0], out[:, 1] = pairs // v, pairs % v
        cdf = self.transition.reshape(v * v, v).cumsum(-1)  # by inverse transform: 6x faster than multinomial rows
        cdf[:, -1] = 1.0  # rounding aside, a uniform draw below 1 lands on a token
        for t in tracked(range(2, length), f"sampling {num_sequences} Markov sequences of {length} tokens"):
            u = torch.rand(num_sequences, 1, dtype=torch.float64, generator=gen)
            out[:, t] = torch.searchsorted(cdf[out[:, t - 2] * v + out[:, t - 1]], u, right=True).squeeze(1)
        return out


class TokenWindows(Dataset):
    """(input, target) pairs shifted by one token from fixed-length sequences."""

    def __init__(self, sequences: Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        seq = self.sequences[index]
        return seq[:-1], seq[1:]


class MarkovData(DataModule):
    """Train/validation/test splits sampled from one ``MarkovChain``.

    Args:
        vocab_size: tokens in the chain. alpha: Dirichlet concentration (smaller: more predictable).
        seq_len: tokens per training example. train_sequences / val_sequences: split sizes.
        batch_size: per-rank batch size. chain_seed: which chain. num_workers: DataLoader workers.
    """

    def __init__(
        self, vocab_size: int = 16, alpha: float = 0.5, seq_len: int = 64, train_sequences: int = 16000,
        val_sequences: int = 512, batch_size: int = 32, chain_seed: int = 1234, num_workers: int = 0,
    ) -> None:
        self.vocab_size, self.alpha, self.seq_len = vocab_size, alpha, seq_len
        self.train_sequences, self.val_sequences = train_sequences, val_sequences
        self.batch_size, self.chain_seed, self.num_workers = check_batch_size(batch_size), chain_seed, num_workers
        self.chain: MarkovChain | None = None
        self._splits: dict[str, Tensor] = {}

    def setup(self, stage: str) -> None:
        if self.chain is None:
            self.chain = MarkovChain(self.vocab_size, self.alpha, self.chain_seed)

    def _split(self, split: str) -> Tensor:
        """A split's sequences, sampled when first asked for (each from its own seed, so the same whichever comes
        first): ``trainkit estimate`` takes one training batch and fit never reads the test split, which at 2048
        tokens take seconds to sample."""
        if split not in self._splits:
            self.setup(split)
            assert self.chain is not None
            count = self.train_sequences if split == "train" else self.val_sequences
            seed = self.chain_seed + {"train": 1, "val": 2, "test": 3}[split]
            self._splits[split] = self.chain.sample(count, self.seq_len + 1, seed=seed)
        return self._splits[split]

    @property
    def entropy_rate(self) -> float:
        if self.chain is None:
            self.setup("fit")
        assert self.chain is not None
        return self.chain.entropy_rate

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(TokenWindows(self._split(split)), batch_size=self.batch_size, shuffle=shuffle,
                          drop_last=shuffle, num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
