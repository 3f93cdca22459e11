"""Callbacks (and a module) that record what a run did, for tests that drive the CLI in subprocesses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainkit.callbacks import Callback
from trainkit.demo.gpt import DemoGPT


class CommProbe(Callback):
    """Writes, on rank 0, every optimizer step's communication bytes by kind (deltas of ``Comm.stats`` over all
    of the strategy's communicators) to ``path``."""

    def __init__(self, path: str = "comm.json") -> None:
        self.path = Path(path)
        self.steps: dict[int, dict[str, int]] = {}
        self._before: dict[str, int] = {}
        self._last = -1

    def _totals(self, trainer: Any) -> dict[str, int]:
        totals: dict[str, int] = {}
        for comm in trainer.strategy.comms():
            for kind, n in comm.stats.bytes.items():
                totals[kind] = totals.get(kind, 0) + n
        return totals

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._before, self._last = self._totals(trainer), trainer.global_step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last or trainer.accumulating:
            return
        self._last = trainer.global_step
        now = self._totals(trainer)
        self.steps[trainer.global_step] = {k: n - self._before.get(k, 0) for k, n in now.items()}
        self._before = now

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.steps))


class BatchProbe(Callback):
    """Writes, on every rank, the sum of each training batch's first tensor to ``<path>.rank<r>.json``: which samples
    a rank read."""

    def __init__(self, path: str = "batches") -> None:
        self.path, self.sums = path, []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        self.sums.append(float(first.double().sum()))

    def on_train_end(self, trainer: Any, module: Any) -> None:
        Path(f"{self.path}.rank{trainer.global_rank}.json").write_text(json.dumps(self.sums))


_POOLS: list = []


class LateWriters(Callback):
    """At the end of training, on each rank, starts a thread that writes ``<path>.thread.<rank>`` half a second later
    and registers an exit handler that writes ``<path>.atexit.<rank>``: work a user's code leaves to the end of the
    process, which the command's quick exit must still let finish. It also leaves a thread pool open with an idle
    worker, as torch.compile does: the exit must tell it to stop, not wait on it forever."""

    def __init__(self, path: str = "late") -> None:
        self.path = path

    def on_train_end(self, trainer: Any, module: Any) -> None:
        import atexit
        import threading
        import time
        from concurrent.futures import ThreadPoolExecutor

        rank, step = trainer.global_rank, trainer.global_step

        def later() -> None:
            time.sleep(0.5)
            Path(f"{self.path}.thread.{rank}").write_text(f"step {step}")

        threading.Thread(target=later).start()
        _POOLS.append(ThreadPoolExecutor(max_workers=1))  # kept, as torch.compile keeps its pool in a global
        _POOLS[-1].submit(int).result()
        atexit.register(lambda: Path(f"{self.path}.atexit.{rank}").write_text(f"step {step}"))


class ReadsTrainer(DemoGPT):
    """The demo model reading ``self.trainer`` in its hooks, as Lightning modules do; writes, on every rank, what
    ``configure_optimizers`` and each ``training_step`` read to ``<path>.rank<r>.json`` when training ends."""

    def __init__(self, path: str = "reads", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path, self.reads = path, []

    def configure_optimizers(self) -> Any:
        self.reads.append(["configure_optimizers", self.trainer.world_size, self.trainer.estimated_stepping_batches])
        return super().configure_optimizers()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.reads.append(["training_step", self.trainer.world_size, self.trainer.global_step])
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        Path(f"{self.path}.rank{self.trainer.global_rank}.json").write_text(json.dumps(self.reads))
