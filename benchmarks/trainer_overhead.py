"""Per-step cost of trainkit's Trainer over a hand-written PyTorch loop, on a tiny MLP.

Both run the same model, pre-made batches and AdamW in one process, alternating, several rounds.
Fixed costs (setup, first-iteration warm-up) are removed by timing two run lengths and taking the
slope: per-step time = (T(long) - T(short)) / (long - short). Printed: raw loop, Trainer with
everything off (no logger, progress bar or checkpointing), Trainer with them on but telemetry off, Trainer
with its defaults (all of them and telemetry: the cost of Telemetry and ThroughputMonitor is the difference), the
overhead in microseconds per step and the ratio to the raw loop.

    python benchmarks/trainer_overhead.py            # full run (~1 min)
    python benchmarks/trainer_overhead.py --smoke    # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import trainkit as tk


class TinyMLP(tk.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_loader(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pre-made batches: data loading is the same cost for both loops, so leave it out of the picture."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps, 16, 32, generator=gen)
    return [(x[i], x[i].sum(1, keepdim=True)) for i in range(steps)]


def raw_loop(template: TinyMLP, steps: int) -> float:
    model = copy.deepcopy(template.net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = make_loader(steps)
    start = time.perf_counter()
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def trainer_loop(template: TinyMLP, steps: int, extras: bool, telemetry: bool = True) -> float:
    module = copy.deepcopy(template)
    loader = make_loader(steps)
    with tempfile.TemporaryDirectory() as root:
        trainer = tk.Trainer(
            accelerator="cpu", max_epochs=1, logger=extras, enable_progress_bar=extras, enable_checkpointing=extras,
            enable_telemetry=telemetry, num_sanity_val_steps=0, default_root_dir=root, log_every_n_steps=50,
        )
        start = time.perf_counter()
        trainer.fit(module, loader)
        return time.perf_counter() - start


def per_step(fn, short: int, long: int, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        out.append((fn(long) - fn(short)) / (long - short))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny run for CI")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    short, long, rounds = (50, 250, 2) if args.smoke else (500, 3000, args.rounds)
    torch.manual_seed(0)
    template = TinyMLP()
    raw_loop(template, short)  # warm up allocator and kernels
    samples: dict[str, list[float]] = {"raw": [], "off": [], "quiet": [], "on": []}
    for _ in range(rounds):  # alternate so drift hits every variant alike
        samples["raw"] += per_step(lambda n: raw_loop(template, n), short, long, 1)
        samples["off"] += per_step(lambda n: trainer_loop(template, n, extras=False), short, long, 1)
        samples["quiet"] += per_step(lambda n: trainer_loop(template, n, extras=True, telemetry=False), short, long, 1)
        samples["on"] += per_step(lambda n: trainer_loop(template, n, extras=True), short, long, 1)
    raw = statistics.median(samples["raw"])
    print(f"tiny MLP, batch 16, 1 thread, {long - short} steps per sample, median of {rounds} rounds")
    print(f"{'variant':<34}{'step (us)':>11}{'overhead (us)':>15}{'ratio':>8}")
    print(f"{'raw PyTorch loop':<34}{raw * 1e6:>11.1f}{'':>15}{1.0:>8.3f}")
    for key, label in (("off", "Trainer (logger/bar/ckpt off)"), ("quiet", "Trainer (on, telemetry off)"),
                       ("on", "Trainer (defaults: all on)")):
        t = statistics.median(samples[key])
        print(f"{label:<34}{t * 1e6:>11.1f}{(t - raw) * 1e6:>15.1f}{t / raw:>8.3f}")


if __name__ == "__main__":
    main()
