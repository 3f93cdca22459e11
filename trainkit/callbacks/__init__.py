from trainkit.callbacks.base import Callback
from trainkit.callbacks.checkpointing import ModelCheckpoint, OnExceptionCheckpoint
from trainkit.callbacks.early_stopping import EarlyStopping
from trainkit.callbacks.finetuning import BaseFinetuning
from trainkit.callbacks.lr_monitor import LearningRateMonitor
from trainkit.callbacks.prediction_writer import PredictionWriter
from trainkit.callbacks.profiler import PyTorchProfiler, SimpleProfiler
from trainkit.callbacks.progress import ProgressBar
from trainkit.callbacks.telemetry import Telemetry
from trainkit.callbacks.throughput import ThroughputMonitor
from trainkit.callbacks.timer import Timer

__all__ = [
    "BaseFinetuning",
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "OnExceptionCheckpoint",
    "PredictionWriter",
    "ProgressBar",
    "PyTorchProfiler",
    "SimpleProfiler",
    "Telemetry",
    "ThroughputMonitor",
    "Timer",
]
