from trainkit.loggers.base import Logger
from trainkit.loggers.csv import CSVLogger
from trainkit.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]

