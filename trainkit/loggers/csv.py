"""``metrics.csv`` (one row per step, a column per metric) and ``hparams.json``."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from trainkit.loggers.base import Logger, flatten_params


class CSVExperiment:
    """A ``CSVLogger``'s ``experiment``, as Lightning's CSV ``ExperimentWriter``: rows and hyperparameters written by
    hand (``self.logger.experiment.log_metrics({"seen": n}, step)``) into the logger's own files."""

    def __init__(self, logger: CSVLogger) -> None:
        self._logger = logger

    @property
    def log_dir(self) -> Path:
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> Path:
        return self._logger.log_dir / "metrics.csv"

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        """One row; without ``step``, the row's number (as Lightning's)."""
        self._logger.log_metrics(metrics_dict, len(self._logger._rows) if step is None else step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self._logger.log_hyperparams(params)

    def save(self) -> None:
        self._logger.save()


class CSVLogger(Logger):
    """Writes ``<root_dir>/<name>/version_<N>/metrics.csv``; the header grows as new metrics appear. ``experiment`` (on
    rank 0; a ``DummyExperiment`` elsewhere) writes rows by hand, as Lightning's."""

    def __init__(self, root_dir: str | Path = "runs", name: str = "trainkit", version: int | str | None = None) -> None:
        super().__init__(root_dir, name, version)
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]
        self._written_rows = 0
        self._written_columns: list[str] = []

    def _experiment(self) -> CSVExperiment:
        return CSVExperiment(self)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._rows.append({"step": step, **metrics})
        self._columns += [k for k in metrics if k not in self._columns]

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "hparams.json").write_text(json.dumps(flatten_params(params), indent=1, default=str))

    def save(self) -> None:
        """Append new rows; rewrite the file only when a new column appeared."""
        if self._written_rows == len(self._rows):
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        rewrite = self._columns != self._written_columns
        rows = self._rows if rewrite else self._rows[self._written_rows :]
        with open(self.log_dir / "metrics.csv", "w" if rewrite else "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            if rewrite:
                writer.writeheader()
            writer.writerows(rows)
        self._written_rows, self._written_columns = len(self._rows), list(self._columns)
