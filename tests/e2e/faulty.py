"""Modules that fail on purpose, for fault tests driven through the CLI."""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

from torch.utils.data import DataLoader, Subset

from trainkit.demo.gpt import DemoGPT
from trainkit.demo.markov import MarkovData


class DiesAtStep(DemoGPT):
    """Rank ``rank`` kills itself (SIGKILL), raises, hangs, freezes (SIGSTOP: alive to the operating system and its
    connections open, but silent, as a peer dead inside NCCL kernels looks to the others), or receives SIGTERM
    (``term``: once per working directory, so the same command run again continues) or sleeps 3 s and goes on (``late``:
    a slow peer, which is no failure) when training reaches ``step``."""

    def __init__(self, rank: int = 1, step: int = 15, how: str = "kill", **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault = (rank, step, how)

    def training_step(self, batch, batch_idx):
        rank, step, how = self.fault
        if self.global_rank == rank and self.global_step == step:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "raise":
                raise RuntimeError("injected failure")
            elif how == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif how == "term":
                marker = Path(f".terminated-rank{rank}")
                if not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGTERM)
            elif how == "late":
                time.sleep(3)
            else:
                time.sleep(3600)
        return super().training_step(batch, batch_idx)


class BrokenModel(DemoGPT):
    """A bug in the user's own code while the model is built (a ValueError, not a configuration error): every rank
    raises it in ``configure_model``."""

    def configure_model(self) -> None:
        super().configure_model()
        raise ValueError("a bug in the user's model")


class NonFiniteAt(DemoGPT):
    """Rank ``rank`` (-1: every rank) makes its loss NaN (``what="loss"``), its input batch NaN (``"input"``: the
    embedding is replaced by NaN), or infinite (``"inf"``) when training reaches optimizer step ``step`` (1-based:
    the step being taken)."""

    def __init__(self, rank: int = -1, step: int = 3, what: str = "loss", **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault = (rank, step, what)

    def training_step(self, batch, batch_idx):
        rank, step, what = self.fault
        out = super().training_step(batch, batch_idx)
        if rank in (-1, self.global_rank) and self.global_step + 1 == step:
            out["loss"] = out["loss"] * (float("inf") if what == "inf" else float("nan"))
        return out


class EmptyOnRank(MarkovData):
    """Rank ``rank``'s own training loader yields nothing (for ``use_distributed_sampler=False``, where each rank
    reads its own part)."""

    def __init__(self, rank: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.empty_rank = rank

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        if int(os.environ.get("RANK", "0")) != self.empty_rank:
            return loader
        return DataLoader(Subset(loader.dataset, []), batch_size=loader.batch_size)


class FileLimitAt(DemoGPT):
    """Rank ``rank`` may not write files past 1 KB (``ulimit -f``, as a full disk fails a write) from optimizer
    step ``step`` on: its next checkpoint file fails with EFBIG."""

    def __init__(self, rank: int = 1, step: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.limit_at = (rank, step)

    def training_step(self, batch, batch_idx):
        rank, step = self.limit_at
        if self.global_rank == rank and self.global_step + 1 == step:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return super().training_step(batch, batch_idx)
