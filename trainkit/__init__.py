"""trainkit: a Lightning-style trainer whose distributed strategies are its own."""

from trainkit.data import DataModule
from trainkit.module import TrainModule
from trainkit.seed import seed_everything
from trainkit.signals import PREEMPTED_EXIT_CODE, Preempted
from trainkit.trainer import Trainer
from trainkit.utilities import rank_zero_only

__version__ = "0.1.0"

__all__ = ["PREEMPTED_EXIT_CODE", "DataModule", "Preempted", "TrainModule", "Trainer", "__version__",
           "rank_zero_only", "seed_everything"]
