"""How long a training step stalls for a checkpoint: synchronous save against asynchronous save.

One process trains an MLP with AdamW (the checkpoint holds fp32 parameters and both Adam moments:
12 bytes a parameter). Every ``--every`` steps a callback saves a checkpoint, synchronously or with
``async_save``, alternating the mode run by run; the stall is the time the save call keeps the
training thread (for async: the host snapshot, the background write continues while training goes on).
Also printed: the step time of the steps that follow a save (async writes compete for memory
bandwidth and cores with training) against steps with no save in flight.

    python benchmarks/checkpoint.py            # 50M parameters, 600 MB checkpoints (~1 min)
    python benchmarks/checkpoint.py --smoke    # tiny; what CI runs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainkit as tk
from trainkit.callbacks import Callback


class Wide(tk.TrainModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Saves(Callback):
    """Saves every ``every`` steps and times the call; times every step."""

    def __init__(self, root: Path, every: int, async_save: bool) -> None:
        self.root, self.every, self.async_save = root, every, async_save
        self.stalls: list[float] = []
        self.after_save: list[float] = []
        self.quiet: list[float] = []
        self._last = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        elapsed = time.perf_counter() - self._last
        if step > 1:
            (self.after_save if step % self.every in (1, 2) else self.quiet).append(elapsed)
        if step % self.every == 0:
            start = time.perf_counter()
            trainer.save_checkpoint(self.root, f"step={step}", async_save=self.async_save)
            self.stalls.append(time.perf_counter() - start)


def run(width: int, layers: int, steps: int, every: int, async_save: bool) -> Saves:
    with tempfile.TemporaryDirectory() as root:
        saves = Saves(Path(root) / "checkpoints", every, async_save)
        trainer = tk.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, enable_model_summary=False, default_root_dir=root,
                             callbacks=[saves])
        data = TensorDataset(torch.randn(8, width))
        trainer.fit(Wide(width, layers), DataLoader(data, batch_size=8))
    return saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    width, layers, steps, every, rounds = (64, 2, 6, 2, 1) if args.smoke else (2048, 12, 21, 5, args.rounds)
    params = layers * (width * width + width)
    results: dict[bool, list[Saves]] = {False: [], True: []}
    for _ in range(rounds):
        for mode in (False, True):
            results[mode].append(run(width, layers, steps, every, mode))
    print(f"MLP {params / 1e6:.1f}M parameters, checkpoint {12 * params / 1e6:.0f} MB, a save every {every} steps, "
          f"{rounds} round(s)")
    stall = {m: statistics.median([s for r in results[m] for s in r.stalls]) for m in results}
    quiet = statistics.median([s for m in results for r in results[m] for s in r.quiet] or [0.0])
    after = {m: statistics.median([s for r in results[m] for s in r.after_save] or [0.0]) for m in results}
    print(f"{'save':<8}{'stall (s)':>11}{'next 2 steps (s)':>18}{'quiet step (s)':>16}")
    for mode, label in ((False, "sync"), (True, "async")):
        print(f"{label:<8}{stall[mode]:>11.3f}{after[mode]:>18.3f}{quiet:>16.3f}")
    print(f"async stall / sync stall: {stall[True] / stall[False]:.3f}")


if __name__ == "__main__":
    main()
