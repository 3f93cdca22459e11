"""TensorBoard event files (scalars + hparams) through torch.utils.tensorboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainkit.loggers.base import Logger, flatten_params


class TensorBoardLogger(Logger):
    """Writes to ``<root_dir>/<name>/version_<N>``; ``tensorboard --logdir <root_dir>`` shows every run."""

    def __init__(self, root_dir: str | Path = "runs", name: str = "trainkit", version: int | str | None = None) -> None:
        super().__init__(root_dir, name, version)
        self._writer: Any = None
        self._hparams: dict[str, Any] = {}

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        self._hparams = flatten_params(params)
        if not self._hparams:
            return
        exp, ssi, sei = hparams({k: ("None" if v is None else v) for k, v in self._hparams.items()}, {})
        file_writer = self.writer._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
