"""Step time of the demo GPT with ``Trainer(compile=True)`` beside the same Trainer in eager mode, one process.

Both train the same model on the same pre-made batches, alternating, several rounds. Compilation and warm-up are
left out by timing two run lengths and taking the slope: per-step time = (T(long) - T(short)) / (long - short).
Printed per round: eager and compiled milliseconds per step, their ratio, and the graphs compiled (the same number
at both lengths: nothing recompiles per step). A speedup is not the point on a CPU; that nothing breaks and nothing
recompiles is.

    python benchmarks/compile.py                   # the demo GPT at its default size (~2 min on 2 cores)
    python benchmarks/compile.py --checkpointing full
    python benchmarks/compile.py --smoke           # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

import trainkit as tk
from trainkit.callbacks import Callback
from trainkit.demo.gpt import DemoGPT


def batches(steps: int, batch: int, block: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (steps, batch, block + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run(args: argparse.Namespace, steps: int, compile: bool) -> tuple[float, int]:
    """Seconds ``steps`` steps took after the first (compilation and warm-up), and the graphs compiled."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    module = DemoGPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.width, warmup_steps=1, max_steps=steps + 1)
    data = batches(steps + 1, args.batch, args.block, args.vocab)

    class Clock(Callback):
        start = 0.0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                self.start = time.perf_counter()

    clock = Clock()
    with tempfile.TemporaryDirectory() as root:
        trainer = tk.Trainer(accelerator="cpu", max_steps=steps + 1, compile=compile, logger=False,
                             enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=root, callbacks=[clock],
                             activation_checkpointing=args.checkpointing)
        trainer.fit(module, data)
    return time.perf_counter() - clock.start, graphs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, nargs=2, default=(10, 30), metavar=("SHORT", "LONG"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpointing", choices=("full", "selective"), default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two lengths, one round")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.width, args.block, args.batch, args.steps, args.rounds = 2, 32, 16, 2, (2, 4), 1
    warnings.filterwarnings("ignore")
    short, long = args.steps
    print(f"demo GPT: {args.layers} layers, width {args.width}, {args.batch} x {args.block} tokens, "
          f"checkpointing {args.checkpointing or 'off'}; {torch.get_num_threads()} threads")
    print(f"{'round':>5}  {'eager ms':>9}  {'compiled ms':>11}  {'compiled/eager':>14}  graphs (short, long)")
    ratios = []
    for r in range(args.rounds):
        eager = (run(args, long, False)[0] - run(args, short, False)[0]) / (long - short)
        t_long, g_long = run(args, long, True)
        t_short, g_short = run(args, short, True)
        compiled = (t_long - t_short) / (long - short)
        ratios.append(compiled / eager)
        print(f"{r:>5}  {eager * 1e3:>9.2f}  {compiled * 1e3:>11.2f}  {ratios[-1]:>14.3f}  {g_short}, {g_long}")
        if g_long != g_short:
            raise SystemExit(f"recompiled: {g_long - g_short} more graphs over {long - short} more steps")
    print(f"median compiled/eager: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
