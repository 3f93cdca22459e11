"""A training script run by torchrun in the elastic-restart tests (tests/e2e/test_elastic.py).

``python elastic_train.py STRATEGY ROOT KILL_STEP``: trains a small regression for 12 steps with a
checkpoint every 2, resuming from the newest one (``ckpt_path="last"``). Every rank appends each
optimizer step's loss to ``ROOT/losses-rank<r>.jsonl``; on the first attempt only
(``TORCHELASTIC_RESTART_COUNT=0``), rank 1 kills itself with SIGKILL when it reaches ``KILL_STEP``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from torch.utils.data import DataLoader

import trainkit as tk
from tests.helpers import Regression, regression_data
from trainkit.callbacks import Callback, ModelCheckpoint


class LossLog(Callback):
    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        record = {"step": trainer.global_step, "loss": float(outputs.detach()),
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        with open(self.root / f"losses-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


class KillOnFirstAttempt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first and trainer.global_rank == 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    strategy, root, kill_step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    trainer = tk.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=12, seed=0, logger=False, enable_progress_bar=False,
        default_root_dir=root, timeout_s=60, enable_model_summary=False,
        callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1), LossLog(root),
                   KillOnFirstAttempt(kill_step)],
    )
    trainer.fit(Regression(dropout=0.1), DataLoader(regression_data(256), batch_size=4, shuffle=True), ckpt_path="last")
