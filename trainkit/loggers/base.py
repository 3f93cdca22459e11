"""Logger interface and the versioned-directory convention ``<root>/<name>/version_<N>``."""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn


def next_version(root: Path) -> int:
    if not root.is_dir():
        return 0
    versions = [int(m.group(1)) for p in root.iterdir() if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return max(versions, default=-1) + 1


class DummyExperiment:
    """What ``experiment`` is on ranks other than 0 (Lightning's ``_DummyExperiment``): every method accepts any
    arguments and does nothing, so a module's ``self.logger.experiment.add_image(...)`` runs on every rank alike."""

    def nop(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: only rank 0 writes."""

    def __getattr__(self, _: str) -> Any:
        return self.nop

    def __getitem__(self, _: Any) -> DummyExperiment:
        return self

    def __setitem__(self, *args: Any) -> None:
        """Nothing: only rank 0 writes."""


def on_rank_zero() -> bool:
    """Whether this process is global rank 0 (the Trainer sets ``rank_zero_only.rank``; before it, the launcher's
    ``RANK``)."""
    return getattr(rank_zero_only, "rank", int(os.environ.get("RANK", "0"))) == 0


class Logger(ABC):
    """Receives metrics and hyperparameters. Only rank 0 calls loggers; a module may also use ``experiment`` (the
    logger's own object) on every rank, where ranks other than 0 get a ``DummyExperiment``."""

    def __init__(self, root_dir: str | Path = "runs", name: str = "trainkit", version: int | str | None = None) -> None:
        self.root_dir = Path(root_dir)
        self.name = name
        self._version = version

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.root_dir / self.name)
        return self._version

    @property
    def log_dir(self) -> Path:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return self.root_dir / self.name / version

    @property
    def experiment(self) -> Any:
        """The logger's own object, created on first use on rank 0; a ``DummyExperiment`` elsewhere."""
        return self._experiment() if on_rank_zero() else DummyExperiment()

    def _experiment(self) -> Any:
        """The object behind ``experiment`` on rank 0."""
        raise AttributeError(f"{type(self).__name__} has no experiment object; use log_metrics and log_hyperparams.")

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def save(self) -> None:
        """Flush what is buffered."""

    def finalize(self, status: str) -> None:
        self.save()


def flatten_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested hyperparameters as ``a/b`` keys with scalar (str for anything else) values."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_params(value, f"{name}/"))
        elif isinstance(value, bool | int | float | str) or value is None:
            out[name] = value
        else:
            out[name] = str(value)
    return out


def finalize_all(loggers: list[Logger], failing: bool) -> None:
    """Finish every logger as a run ends. Under the run's own error (a full disk, say, which fails the loggers too)
    a logger's failure is a warning, so the run's error stays the one in front of the user."""
    for logger in loggers:
        try:
            logger.finalize("failed" if failing else "finished")
        except OSError as err:
            if not failing:
                raise
            rank_zero_warn(f"{type(logger).__name__} could not finish writing: {err}")
