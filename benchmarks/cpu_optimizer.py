"""The host half of an offloaded step beside torch's fused AdamW, DeepSpeedCPUAdam and a plain copy, on the same sizes.

What a GPU step waits on under ZeRO-Offload is the host step: gradients arrive in bf16, the fp32 master and Adam
moments are updated, and the parameters go back in bf16. trainkit runs it in one pass per run of buckets
(``trainkit_strategies/offload/host_adam.py``, a C kernel built on first use). Variants, each moving about the same
bytes:

- torch ``AdamW(fused=True)`` stepping fp32 tensors with a ready fp32 gradient: read 16 bytes a parameter, write 12;
- trainkit's step of ``zero_offload`` under bf16-mixed as on a CPU device (``step_shards``: bf16 gradient in, the
  bf16 working parameters out with streaming stores: read 14, write 14), and its fp32 run (precision "32": read 16,
  write 16, plus the read of the fp32 output's lines before they are written: 36);
- trainkit's step as on a GPU (``HostAdam``, the bf16 parameters written over the bf16 gradient they came from);
- the same with torch's kernels, the fallback where no C compiler exists (convert, fused step, copy: 40 bytes);
- DeepSpeedCPUAdam (``DS_ACCELERATOR=cpu``, when DeepSpeed is installed) stepping fp32 gradients, plus the bf16 copy
  of the parameters DeepSpeed's engine makes after it (34 bytes);
- a plain copy of 14 bytes a parameter (read 14, write 14): what the memory system gives a pass of 28 bytes.

Variants alternate within a round; the median over rounds is printed as parameters per second, GB/s of the bytes
above, and ratios to torch's fused AdamW and to DeepSpeed at the same thread count, then the gain from each thread
count over one thread.

    python benchmarks/cpu_optimizer.py                              # 16M and 64M parameters, 1 and 2 threads
    python benchmarks/cpu_optimizer.py --numel 1G --threads 16      # a GPU host's cores
    python benchmarks/cpu_optimizer.py --smoke                      # 1M parameters (CI)
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
from trainkit_strategies.offload import host_adam as host_adam_module
from trainkit_strategies.offload import native
from trainkit_strategies.offload.host_adam import HostAdam

Variant = tuple[Callable[[], None], int]  # (one step, bytes a parameter it moves)
FUSED, OURS = "torch AdamW(fused=True), fp32", "trainkit bf16 in, bf16 out (CPU device)"
DS = "DeepSpeedCPUAdam fp32 + bf16 copy"


def size(text: str) -> int:
    """16M, 64M, 1G, or a number of elements."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def offloaded(numel: int, precision: str) -> Callable[[], None]:
    """trainkit's host step as ``zero_offload`` runs it on a CPU device, over one Linear of ``numel`` weights."""
    torch.manual_seed(0)
    model = nn.Linear(numel // 1024, 1024, bias=False)
    strategy = get_strategy("zero_offload")
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), Precision.from_name(precision))
    for grads in strategy.grads.buffers:
        grads.normal_()
    return strategy.step_shards


def in_place(numel: int, fallback: bool = False) -> Callable[[], None]:
    """trainkit's host step as on a GPU: bf16 gradient in, the bf16 parameters written over it."""
    master = torch.randn(numel)
    grad = torch.randn(numel).bfloat16()
    adam = HostAdam(torch.optim.AdamW([master], lr=1e-3), [(master, 0, [(master, 0)])])
    threads = torch.get_num_threads()

    def step() -> None:
        kernel = host_adam_module._kernel
        if fallback:
            host_adam_module._kernel = lambda: None
        try:
            adam.begin(1.0, threads)
            adam.step([master], [grad], [grad])
        finally:
            host_adam_module._kernel = kernel

    return step


def fused(numel: int) -> Callable[[], None]:
    param = torch.randn(numel, requires_grad=True)
    param.grad = torch.randn(numel)
    return torch.optim.AdamW([param], lr=1e-3, fused=True).step


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


def copy(numel: int) -> Callable[[], None]:
    source, target = torch.randn(numel * 7 // 2), torch.empty(numel * 7 // 2)
    return lambda: target.copy_(source)


def variants(numel: int) -> dict[str, Variant]:
    out: dict[str, Variant] = {
        FUSED: (fused(numel), 28),
        OURS: (offloaded(numel, "bf16-mixed"), 28),
        "trainkit bf16 in, over the gradient (GPU)": (in_place(numel), 28),
        "trainkit fp32 in, fp32 out (precision 32)": (offloaded(numel, "32"), 36),
        "trainkit on torch's kernels (no compiler)": (in_place(numel, fallback=True), 40),
    }
    ds = deepspeed_adam(numel)
    if ds is not None:
        out[DS] = (ds, 34)
    out["plain copy of 28 bytes a parameter"] = (copy(numel), 28)
    return out


def timed(fn: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def measure(numel: int, threads: int, rounds: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    found = variants(numel)
    for fn, _ in found.values():
        fn()  # optimizer state allocation, first touch of every page
    samples: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(rounds):
        for name, (fn, _) in found.items():
            samples[name].append(timed(fn, steps))
    rates = {name: numel / statistics.median(s) for name, s in samples.items()}
    print(f"\n{numel / 2**20:.0f}M parameters, {threads} thread(s), median of {rounds} rounds x {steps} steps")
    print(f"{'step':<46}{'ms':>8}{'Mparams/s':>11}{'GB/s':>7}{'vs torch':>10}{'vs DS':>8}")
    for name, rate in rates.items():
        vs_ds = f"{rate / rates[DS]:>8.3f}" if DS in rates else f"{'-':>8}"
        print(f"{name:<46}{numel / rate * 1e3:>8.2f}{rate / 1e6:>11.0f}{rate * found[name][1] / 1e9:>7.1f}"
              f"{rate / rates[FUSED]:>10.3f}{vs_ds}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--numel", default="16M,64M", help="parameter counts, comma-separated (16M, 1G, ...)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    sizes = [2**20] if args.smoke else [size(n) for n in args.numel.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rounds, steps = (2, 2) if args.smoke else (args.rounds, args.steps)
    kernel = "compiled kernel" if host_adam_module.uses_kernel() else f"torch's kernels ({native.why_not('host_adam')})"
    print(f"trainkit's host step runs: {kernel}" + ("" if importlib.util.find_spec("deepspeed")
                                                     else "; DeepSpeed not installed"))
    for numel in sizes:
        results = {t: measure(numel, t, rounds, steps) for t in threads}
        if len(threads) > 1:
            base = results[threads[0]]
            print(f"\ngain over {threads[0]} thread(s), {numel / 2**20:.0f}M parameters (and against torch's gain)")
            for name in base:
                gains = [(t, results[t][name] / base[name], results[t][FUSED] / base[FUSED]) for t in threads[1:]]
                print(f"{name:<46}" + "  ".join(f"{t} threads: {g:.2f}x ({g / ref:.2f} of torch's)"
                                                 for t, g, ref in gains))


if __name__ == "__main__":
    main()
