"""The host half of an offloaded step beside torch's fused AdamW and DeepSpeedCPUAdam, on the same tensors.

What a GPU step waits on under ZeRO-Offload is the host step: gradients arrive in bf16, the fp32 master
and Adam moments are updated, and the parameters go back in bf16. trainkit runs it as
``ZeroOffloadStrategy.step_shards()``: torch's fused CPU AdamW chunk by chunk, each chunk's gradient
converted in cache and each chunk's updated master written back in bf16 (``host_adam.py``). It is timed
against:

- torch ``AdamW(fused=True)`` stepping fp32 tensors with a ready fp32 gradient: no conversion at all,
  the rate to match;
- DeepSpeedCPUAdam (``DS_ACCELERATOR=cpu``, when DeepSpeed is installed) stepping fp32 gradients, plus the
  bf16 copy of the parameters DeepSpeed's engine makes after it (DeepSpeed 0.19 has no ``fp16_param_groups``
  pass that writes it during the step; older releases did).

Variants alternate; the median over rounds is printed as parameters per second and as ratios.

    python benchmarks/cpu_optimizer.py            # 16M parameters (~1 min)
    python benchmarks/cpu_optimizer.py --smoke    # 1M parameters (CI)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from trainkit_strategies import Environment, Precision, get_strategy


def offloaded(numel: int, precision: str) -> tuple[Callable[[], None], int]:
    """trainkit's host step: ``precision`` "32" (fp32 in and out) or "bf16-mixed" (bf16 in, bf16 out)."""
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


def deepspeed_adam(numel: int) -> Callable[[], None] | None:
    if importlib.util.find_spec("deepspeed") is None:
        return None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.randn(numel)
    param.grad = torch.randn(numel)
    opt = DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=True)
    bf16 = torch.empty(numel, dtype=torch.bfloat16)

    def step() -> None:
        opt.step()
        bf16.copy_(param)  # the compute-dtype copy the engine sends back

    return step


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
    ours32, n = offloaded(numel, "32")
    ours16, _ = offloaded(numel, "bf16-mixed")
    variants = {
        "torch AdamW(fused=True), fp32 in/out": reference(numel),
        "trainkit zero_offload step (32)": ours32,
        "trainkit zero_offload step (bf16 in, bf16 out)": ours16,
    }
    ds = deepspeed_adam(numel)
    if ds is not None:
        variants["DeepSpeedCPUAdam fp32 + bf16 copy"] = ds
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # optimizer state allocation
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timed(fn, steps))
    t = {name: statistics.median(s) for name, s in samples.items()}
    ref = t["torch AdamW(fused=True), fp32 in/out"]
    print(f"{n / 1e6:.1f}M parameters, {args.threads} thread(s), median of {rounds} rounds x {steps} steps"
          + ("" if ds is not None else "; DeepSpeed not installed"))
    print(f"{'step':<48}{'ms':>8}{'Mparams/s':>11}{'vs torch':>10}{'vs DS':>8}")
    for name, value in t.items():
        vs_ds = f"{t['DeepSpeedCPUAdam fp32 + bf16 copy'] / value:>8.3f}" if ds is not None else ""
        print(f"{name:<48}{value * 1e3:>8.2f}{n / value / 1e6:>11.0f}{ref / value:>10.3f}{vs_ds}")


if __name__ == "__main__":
    main()
