from trainkit.callbacks.base import Callback
from trainkit.callbacks.checkpointing import ModelCheckpoint, OnExceptionCheckpoint
from trainkit.callbacks.early_stopping import EarlyStopping
from trainkit.callbacks.lr_monitor import LearningRateMonitor
from trainkit.callbacks.progress import ProgressBar
from trainkit.callbacks.throughput import ThroughputMonitor

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "ThroughputMonitor",
]
