"""TensorBoard event files (scalars + hparams), written synchronously with tensorboard's record format."""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any

from trainkit.loggers.base import Logger, flatten_params

_FILES = itertools.count()  # a fit and a test in one process and one second write two files, not one twice


class TensorBoardLogger(Logger):
    """Writes to ``<root_dir>/<name>/version_<N>``; ``tensorboard --logdir <root_dir>`` shows every run.

    Scalars and hyperparameters go to one event file, written by the calling thread into a buffered file
    (one event per ``log_metrics`` call, holding all its scalars) and flushed by ``save()``: no writer
    thread competes with the training loop. ``experiment`` is a ``torch.utils.tensorboard.SummaryWriter`` on the
    same directory, created on first use on rank 0, for anything else (``self.logger.experiment.add_histogram``,
    ``add_image``, graphs), as Lightning's; on other ranks it is a ``DummyExperiment``.
    """

    def __init__(self, root_dir: str | Path = "runs", name: str = "trainkit", version: int | str | None = None) -> None:
        super().__init__(root_dir, name, version)
        self._writer: Any = None
        self._file: Any = None
        self._records: Any = None
        self._hparams: dict[str, Any] = {}

    def _experiment(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def _write(self, **fields: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        if self._records is None:
            from tensorboard.summary.writer.record_writer import RecordWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
            name = f"events.out.tfevents.{stamp}.trainkit"
            self._file = open(self.log_dir / name, "wb")  # noqa: SIM115 (closed by finalize)
            self._records = RecordWriter(self._file)
            self._records.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self._records.write(Event(wall_time=time.time(), **fields).SerializeToString())

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
        self._write(step=step, summary=Summary(value=values))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self._hparams = flatten_params(params)
        if not self._hparams:
            return
        exp, ssi, sei = hparams({k: ("None" if v is None else v) for k, v in self._hparams.items()}, {})
        for summary in (exp, ssi, sei):
            self._write(summary=summary)

    def save(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        self.save()
        if self._file is not None:
            self._file.close()
            self._file = self._records = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
