"""Telemetry: what a step moved, how its time split, and how much memory the process holds.

Logged every ``log_every_n_steps`` optimizer steps, to every logger:

- ``comm/<kind>_bytes``: payload of the last optimizer step per collective kind (``all_reduce``,
  ``reduce_scatter``, ``all_gather``, ``broadcast``, ``send``/``recv``), from the strategy's ``Comm``
  statistics: the numbers ``Comm.stats`` holds, as deltas over that step;
- ``time/forward_backward_ms``, ``time/optimizer_ms``: host time of the last window's forward and
  backward passes and of its optimizer step (reduction, clipping, update); ``time/comm_wait_ms``: the part
  of both spent inside torch.distributed calls (waiting for a collective, or running a blocking one). On a
  GPU these are host-side times: work the GPU runs asynchronously is counted where the host waits for it;
- ``memory/``: on CUDA ``allocated_mb``, ``reserved_mb`` and ``peak_mb`` of the rank's device; on the CPU
  the process's resident ``rss_mb``.

It costs a dictionary copy per optimizer step, and a few reads per logged step.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from trainkit.callbacks.base import Callback

if TYPE_CHECKING:
    from trainkit.hooks import StepTiming
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """The process's resident memory now (Linux: /proc/self/statm, kept open and re-read)."""
    global _STATM
    try:
        if _STATM is None or _STATM[0] != os.getpid():  # /proc/self names the process that opened it
            _STATM = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_STATM: tuple[int, int] | None = None  # (pid, fd)


class Telemetry(Callback):
    """Logs ``comm/``, ``time/`` and ``memory/`` scalars (see the module docstring).

    Args:
        comm, timing, memory: which groups to log.
    """

    def __init__(self, comm: bool = True, timing: bool = True, memory: bool = True) -> None:
        self.comm, self.timing, self.memory = comm, timing, memory
        self._bytes: dict[str, int] = {}
        self._wait = 0.0
        self.last: dict[str, float] = {}

    def _totals(self, trainer: Trainer) -> tuple[dict[str, int], float]:
        totals: dict[str, int] = {}
        wait = 0.0
        for comm in trainer.strategy.comms():
            for kind, n in comm.stats.bytes.items():
                totals[kind] = totals.get(kind, 0) + n
            wait += comm.stats.wait_s
        return totals, wait

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._bytes, self._wait = self._totals(trainer)

    def on_train_step_end(self, trainer: Trainer, module: TrainModule, timing: StepTiming) -> None:
        step = trainer.global_step
        totals, wait = self._totals(trainer)
        if step % trainer.log_every_n_steps == 0:
            metrics: dict[str, float] = {}
            if self.comm:
                metrics |= {f"comm/{k}_bytes": float(n - self._bytes.get(k, 0)) for k, n in totals.items()}
            if self.timing:
                metrics["time/forward_backward_ms"] = timing.forward_backward_s * 1e3
                metrics["time/optimizer_ms"] = timing.optimizer_s * 1e3
                metrics["time/comm_wait_ms"] = (wait - self._wait) * 1e3
            if self.memory:
                metrics |= self._memory(trainer.strategy.device)
            self.last = metrics
            trainer.log_metrics(metrics, step)
        self._bytes, self._wait = totals, wait

    @staticmethod
    def _memory(device: torch.device) -> dict[str, float]:
        if device.type == "cuda":
            mb = 2**20
            return {"memory/allocated_mb": torch.cuda.memory_allocated(device) / mb,
                    "memory/reserved_mb": torch.cuda.memory_reserved(device) / mb,
                    "memory/peak_mb": torch.cuda.max_memory_allocated(device) / mb}
        return {"memory/rss_mb": rss_bytes() / 2**20}
