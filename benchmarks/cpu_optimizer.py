"""The offloaded optimizer step against torch.optim.AdamW(fused=True) on the same tensors.

trainkit's ZeRO-Offload steps master weights held in host memory with the user's optimizer
re-targeted onto them (torch's fused CPU AdamW). Its host-side step is ``step_shards()``: hand the
reduced gradient partition to the host in the master dtype, run the optimizer, release the gradients.
This script times that step against a bare ``torch.optim.AdamW(fused=True)`` stepping a tensor of the
same size with a ready fp32 gradient, alternating, and prints parameters per second and the ratio.
With "32" the hand-off is free; with "bf16-mixed" it includes converting bf16 gradients to fp32.

    python benchmarks/cpu_optimizer.py            # 16M parameters (~1 min)
    python benchmarks/cpu_optimizer.py --smoke    # 1M parameters (CI)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from trainkit_strategies import Environment, Precision, get_strategy


def offloaded(numel: int, precision: str) -> tuple[Callable[[], None], int]:
    torch.manual_seed(0)
    model = nn.Linear(numel // 1024, 1024, bias=False)
    strategy = get_strategy("zero_offload")
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), Precision.from_name(precision))
    for grads in strategy.grads.buffers:
        grads.normal_()
    return strategy.step_shards, sum(p.numel() for p in model.parameters())


def reference(numel: int) -> Callable[[], None]:
    param = torch.randn(numel, requires_grad=True)
    param.grad = torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    return opt.step


def timed(fn: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numel = 2**20 if args.smoke else 2**24
    rounds, steps = (2, 2) if args.smoke else (args.rounds, 5)
    ref = reference(numel)
    print(f"{numel / 1e6:.1f}M parameters, {args.threads} thread(s), median of {rounds} rounds x {steps} steps")
    print(f"{'step':<44}{'ms':>8}{'Mparams/s':>11}{'ratio':>8}")
    for precision in ("32", "bf16-mixed"):
        ours, n = offloaded(numel, precision)
        ours(), ref()  # warm up (optimizer state allocation)
        samples_ours, samples_ref = [], []
        for _ in range(rounds):
            samples_ours.append(timed(ours, steps))
            samples_ref.append(timed(ref, steps))
        t_ours, t_ref = statistics.median(samples_ours), statistics.median(samples_ref)
        print(f"{'torch AdamW(fused=True)':<44}{t_ref * 1e3:>8.2f}{n / t_ref / 1e6:>11.0f}{1.0:>8.3f}")
        label = f"trainkit zero_offload step_shards ({precision})"
        print(f"{label:<44}{t_ours * 1e3:>8.2f}{n / t_ours / 1e6:>11.0f}{t_ref / t_ours:>8.3f}")


if __name__ == "__main__":
    main()
