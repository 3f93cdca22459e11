"""trainkit ``zero_offload`` beside DeepSpeed's ZeRO-2 with ``offload_optimizer: cpu``, same model, same run.

Both train the same model in bf16-mixed with AdamW, their fp32 master weights and Adam state in host
memory. On the CPU (DeepSpeed with ``DS_ACCELERATOR=cpu``) the variants take turns, rounds of
``--steps`` steps rotating, at 1 and 2 ranks (gloo); each is also run alone to read its peak resident
memory. With ``--gpu`` (one CUDA device) they train the GPT configurations of issue 13 (124M
parameters, batch 8x1024; 5.4B parameters, d=4096, 26 layers, batch 1x1024): step time is the median
of synchronised per-step times after warm-up, memory is ``torch.cuda.max_memory_allocated``.
DeepSpeed is a reference only: the script skips it, saying so, when it is not installed.

    python benchmarks/offload.py                  # CPU, 1 and 2 ranks (~2 min)
    python benchmarks/offload.py --smoke          # tiny, what CI runs
    python benchmarks/offload.py --gpu            # on a CUDA machine: 124M and 5.4B
    python benchmarks/offload.py --gpu --shapes gpt-5.4B --phases   # + trainkit's phases and host-step timeline
    python benchmarks/offload.py --gpu --shapes gpt-tiny --device cpu --phases   # a dry run of the above here

On the GPU each variant runs in a process of its own (its host RSS is then its own), builds the model in host
memory, and reports its setup time, the median step after 3 warm-up steps (synchronised, 2 x ``--steps`` steps),
the peak allocated and reserved device memory over those steps, and its peak RSS. ``--phases`` adds trainkit's
step cut into forward, backward, reduce_gradients, optimizer_step and zero_grad (each synchronised, median of
``--steps``) and the timeline of one step: when each host run started and ended against backward's start and end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import free_port, run_ranks
from torch import nn

from trainkit.demo.gpt import GPTConfig, TinyGPT
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm

Step = Callable[[], None]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
AFTER = "trainkit zero_offload (step after backward)"  # overlap_step=False: as with clipping or fp16
DURING = "trainkit zero_offload (step during backward)"  # overlap_step=True, also where the device is the host
GPT_SHAPES = {  # name -> (GPTConfig kwargs, batch, sequence)
    "gpt-tiny": (dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64), 2, 64),  # a dry run on the CPU
    "gpt-124M": (dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), 8, 1024),
    "gpt-5.4B": (dict(vocab_size=50304, block_size=1024, n_layer=26, n_head=32, n_embd=4096), 1, 1024),
}


def mlp(width: int, hidden: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                           for _ in range(blocks)])


def trainkit_variant(model: nn.Module, env: Environment, batch: Callable[[], tuple], loss_fn: Callable,
                     strategy: Any = None) -> Step:
    """trainkit's step as the Trainer takes it with no clipping and no loss scaling: on a GPU each bucket steps on the
    host as soon as its gradients land (as ``overlap_step`` says)."""
    strategy = strategy or get_strategy("zero_offload")
    strategy.setup_environment(env, Comm(env.world_size, env.rank, device=env.device) if env.world_size > 1 else None)
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), Precision.from_name("bf16-mixed"))

    def step() -> None:
        with strategy.forward_context():
            loss = loss_fn(model, *batch())
        strategy.step_in_backward(1.0 / env.world_size)
        strategy.backward(loss)
        strategy.reduce_gradients(1.0 / env.world_size)
        strategy.optimizer_step()
        strategy.zero_grad()

    return step


def deepspeed_variant(model: nn.Module, micro_batch: int, batch: Callable[[], tuple], loss_fn: Callable) -> Step:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "reduce_bucket_size": 25 * 2**20 // 2, "allgather_bucket_size": 25 * 2**20 // 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

    def step() -> None:
        inputs = batch()
        loss = loss_fn(engine, *(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs))
        engine.backward(loss)
        engine.step()

    return step


def mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), x.float())


def lm_loss(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1).float(), target.flatten())


def _join(rank: int, world: int, port: int) -> Environment:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    env = Environment.from_env("cpu", timeout_s=600)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return env


def _shape(args: argparse.Namespace) -> tuple[tuple[int, int, int], int]:
    return ((64, 128, 2), 8) if args.smoke else ((512, 2048, 4), 32)


def _timing_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    env = _join(rank, world, port)
    shape, micro = _shape(args)
    x = torch.randn(micro, shape[0], generator=torch.Generator().manual_seed(rank))
    variants = {"trainkit zero_offload": trainkit_variant(mlp(*shape), env, lambda: (x,), mse),
                DURING: trainkit_variant(mlp(*shape), env, lambda: (x,), mse, get_strategy("zero_offload",
                                                                                           overlap_step=True))}
    if HAS_DEEPSPEED:
        if world == 1 and not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        variants["DeepSpeed ZeRO-2 offload"] = deepspeed_variant(mlp(*shape), micro, lambda: (x,), mse)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in variants.values():
        for _ in range(2):
            step()
    order = list(variants.items())
    for r in range(args.rounds):
        for name, step in order[r % len(order):] + order[: r % len(order)]:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        out.update({name: statistics.median(ts) for name, ts in times.items()})
    _leave()


def _memory_worker(rank: int, world: int, port: int, args: argparse.Namespace, name: str, out: dict) -> None:
    """One variant alone: the growth of peak resident memory over the post-import baseline."""
    env = _join(rank, world, port)
    if world == 1 and name.startswith("DeepSpeed"):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    shape, micro = _shape(args)
    x = torch.randn(micro, shape[0], generator=torch.Generator().manual_seed(rank))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if name.startswith("trainkit"):
        step = trainkit_variant(mlp(*shape), env, lambda: (x,), mse,
                                get_strategy("zero_offload", overlap_step=True if name == DURING else None))
    else:
        step = deepspeed_variant(mlp(*shape), micro, lambda: (x,), mse)
    for _ in range(3):
        step()
    if rank == 0:
        out[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    _leave()


def _leave() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalisation, where c10d destructors have aborted a rank now and then


def cpu(args: argparse.Namespace) -> None:
    shape, micro = _shape(args)
    print(f"CPU, MLP {shape[2]} x [{shape[0]} -> {shape[1]} -> {shape[0]}], batch {micro} per rank, bf16-mixed, "
          f"AdamW; median of {args.rounds} rounds x {args.steps} steps")
    if not HAS_DEEPSPEED:
        print("DeepSpeed is not installed: trainkit alone (pip install deepspeed; DS_ACCELERATOR=cpu)")
    for world in (1, 2):
        times = run_ranks(_timing_worker, world, args)
        memory = {name: run_ranks(_memory_worker, world, args, name)[name] for name in times}
        ours = "trainkit zero_offload"
        for name, t in times.items():
            line = f"W={world}  {name:<46}{t * 1e3:>9.1f} ms  peak RSS +{memory[name] / 2**20:>7.1f} MiB"
            if name.startswith("DeepSpeed"):
                line += f"   trainkit/DeepSpeed: time {times[ours] / t:.3f}x, memory {memory[ours] / memory[name]:.3f}x"
            elif name != ours:
                line += f"   this / the default: {t / times[ours]:.3f}x"
            print(line)


def _variant_worker(args: argparse.Namespace) -> None:
    """One variant on one shape, alone in this process (so that its host memory is its own): setup time, median step,
    peak device memory, host RSS, and for trainkit the step's phases and when its host steps ran."""
    device = torch.device(args.device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    env = Environment(device=device)
    config, micro, seq = GPT_SHAPES[args.shape]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    idx = torch.randint(0, config["vocab_size"], (micro, seq + 1), device=device)
    batch = lambda: (idx[:, :-1], idx[:, 1:])
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(**config))
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    if args.variant.startswith("trainkit"):
        strategy = get_strategy("zero_offload", overlap_step={AFTER: False, DURING: True}.get(args.variant))
        step = trainkit_variant(model, env, batch, lm_loss, strategy)
    else:
        step = deepspeed_variant(model, micro, batch, lm_loss)
    sync()
    result: dict = {"variant": args.variant, "shape": args.shape, "params": params,
                    "setup_s": time.perf_counter() - start}
    for _ in range(3):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps * 2):
        sync()
        begin = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - begin)
    result["step_ms"] = statistics.median(times) * 1e3
    if cuda:
        result["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        result["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    if args.phases and args.variant.startswith("trainkit"):
        result |= _phases(strategy, model, batch, sync, args.steps)
    result["host_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print("RESULT " + json.dumps(result), flush=True)
    _leave()


def _phases(strategy: Any, model: nn.Module, batch: Callable[[], tuple], sync: Callable[[], None],
            steps: int) -> dict:
    """The step's phases, synchronised (median of ``steps``), and one step's timeline of host runs against backward."""
    from trainkit_strategies.offload.host_adam import HostAdam

    runs: list[tuple[float, float, int]] = []
    real = HostAdam.step

    def timed_run(self: HostAdam, pieces: list, *rest: Any) -> None:
        begin = time.perf_counter()
        real(self, pieces, *rest)
        runs.append((begin, time.perf_counter(), sum(p.numel() for p in pieces)))

    HostAdam.step = timed_run  # type: ignore[method-assign]
    phases: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "reduce_gradients", "optimizer_step",
                                                       "zero_grad")}
    marks: dict[str, float] = {}
    for _ in range(steps):
        runs.clear()
        sync()
        t = time.perf_counter()
        with strategy.forward_context():
            loss = lm_loss(model, *batch())
        sync()
        marks["backward_start"] = now = time.perf_counter()
        phases["forward"].append(now - t)
        strategy.step_in_backward(1.0)  # as the Trainer does with nothing to wait for (no clipping, no fp16)
        strategy.backward(loss)
        sync()
        marks["backward_end"] = now2 = time.perf_counter()
        phases["backward"].append(now2 - now)
        for name, fn in (("reduce_gradients", lambda: strategy.reduce_gradients(1.0)),
                         ("optimizer_step", strategy.optimizer_step), ("zero_grad", strategy.zero_grad)):
            t = time.perf_counter()
            fn()
            sync()
            phases[name].append(time.perf_counter() - t)
    HostAdam.step = real  # type: ignore[method-assign]
    base, end = marks["backward_start"], marks["backward_end"]
    during = [r for r in runs if r[0] < end]
    return {
        "phases_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        "timeline": {
            "backward_ms": (end - base) * 1e3,
            "host_runs": len(runs),
            "runs_started_during_backward": len(during),
            "elements_stepped_during_backward": sum(r[2] for r in during),
            "elements": sum(r[2] for r in runs),
            "first_run_start_ms": (min(r[0] for r in runs) - base) * 1e3 if runs else None,
            "last_run_end_ms": (max(r[1] for r in runs) - base) * 1e3 if runs else None,
            "runs_ms": [((r[0] - base) * 1e3, (r[1] - base) * 1e3, r[2]) for r in runs],
        },
    }


def gpu(args: argparse.Namespace) -> None:
    """Every variant on every shape asked for, each in its own process; a table of what they measured."""
    names = args.variants.split(",") if args.variants else (
        ["trainkit zero_offload"] + (["DeepSpeed ZeRO-2 offload"] if HAS_DEEPSPEED else []))
    rows = []
    for shape in args.shapes.split(","):
        for name in names:
            command = [sys.executable, __file__, "--variant", name, "--shape", shape, "--steps", str(args.steps),
                       "--device", args.device] + (["--phases"] if args.phases else [])
            proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not found:
                print(f"{shape} {name}: FAILED (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}",
                      flush=True)
                continue
            row = json.loads(found[-1][7:])
            rows.append(row)
            print(f"{shape} ({row['params'] / 1e9:.2f}B)  {name:<40}{row['step_ms']:>9.1f} ms  "
                  f"peak {row.get('peak_allocated_gb', 0):.2f} GB (reserved {row.get('peak_reserved_gb', 0):.2f})  "
                  f"host RSS {row['host_rss_gb']:.1f} GB  setup {row['setup_s']:.0f} s", flush=True)
            if "phases_ms" in row:
                print("  phases (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in row["phases_ms"].items()))
                line = row["timeline"]
                print(f"  timeline: backward {line['backward_ms']:.0f} ms; {line['runs_started_during_backward']} of "
                      f"{line['host_runs']} host runs ({line['elements_stepped_during_backward'] / 1e9:.2f}B of "
                      f"{line['elements'] / 1e9:.2f}B parameters) started before backward ended; first at "
                      f"{line['first_run_start_ms']:.0f} ms, last done at {line['last_run_end_ms']:.0f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    by_shape: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_shape.setdefault(row["shape"], {})[row["variant"]] = row
    for shape, found in by_shape.items():
        ours, theirs = found.get("trainkit zero_offload"), found.get("DeepSpeed ZeRO-2 offload")
        if ours and theirs:
            print(f"{shape}: trainkit/DeepSpeed step {ours['step_ms'] / theirs['step_ms']:.3f}x, peak allocated "
                  f"{ours.get('peak_allocated_gb', 0) / max(theirs.get('peak_allocated_gb', 0), 1e-9):.3f}x, host RSS "
                  f"{ours['host_rss_gb'] / theirs['host_rss_gb']:.3f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shapes", default="gpt-124M,gpt-5.4B", help=f"--gpu: of {', '.join(GPT_SHAPES)}")
    parser.add_argument("--variants", default="", help="--gpu: comma-separated (default: trainkit and DeepSpeed)")
    parser.add_argument("--phases", action="store_true", help="--gpu: trainkit's phases and host-step timeline")
    parser.add_argument("--device", default="cuda", help="--gpu: the device (cpu: a dry run of the GPU path)")
    parser.add_argument("--timeout", type=float, default=900, help="--gpu: seconds per variant")
    parser.add_argument("--json", default="", help="--gpu: write the rows here")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    if args.variant:
        _variant_worker(args)
    else:
        (gpu if args.gpu else cpu)(args)


if __name__ == "__main__":
    main()
