from collections.abc import Sequence
from pathlib import Path

from trainkit.loggers.base import Logger
from trainkit.loggers.csv import CSVLogger
from trainkit.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]


def resolve_loggers(logger: bool | Logger | Sequence[Logger] | None, root: Path) -> list[Logger]:
    """The Trainer's ``logger`` argument as a list: True is TensorBoard under ``root``, False or None none."""
    if logger is True:
        return [TensorBoardLogger(root)]
    if logger is False or logger is None:
        return []
    return list(logger) if isinstance(logger, Sequence) else [logger]
