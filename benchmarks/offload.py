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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import free_port, run_ranks
from torch import nn

from trainkit.demo.gpt import GPTConfig, TinyGPT
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.comm import Comm

Step = Callable[[], None]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
GPT_SHAPES = {  # name -> (GPTConfig kwargs, batch, sequence)
    "gpt-124M": (dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), 8, 1024),
    "gpt-5.4B": (dict(vocab_size=50304, block_size=1024, n_layer=26, n_head=32, n_embd=4096), 1, 1024),
}


def mlp(width: int, hidden: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                           for _ in range(blocks)])


def trainkit_variant(model: nn.Module, env: Environment, batch: Callable[[], tuple], loss_fn: Callable) -> Step:
    strategy = get_strategy("zero_offload")
    strategy.setup_environment(env, Comm(env.world_size, env.rank, device=env.device) if env.world_size > 1 else None)
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), Precision.from_name("bf16-mixed"))

    def step() -> None:
        with strategy.forward_context():
            loss = loss_fn(model, *batch())
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
    variants = {"trainkit zero_offload": trainkit_variant(mlp(*shape), env, lambda: (x,), mse)}
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
        step = trainkit_variant(mlp(*shape), env, lambda: (x,), mse)
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
            line = f"W={world}  {name:<28}{t * 1e3:>9.1f} ms  peak RSS +{memory[name] / 2**20:>7.1f} MiB"
            if name != ours:
                line += f"   trainkit/DeepSpeed: time {times[ours] / t:.3f}x, memory {memory[ours] / memory[name]:.3f}x"
            print(line)


def gpu(args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    env = Environment(device=device)
    names = ["trainkit zero_offload"] + (["DeepSpeed ZeRO-2 offload"] if HAS_DEEPSPEED else [])
    for label, (config, micro, seq) in GPT_SHAPES.items():
        idx = torch.randint(0, config["vocab_size"], (micro, seq + 1), device=device)
        for name in names:
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            model = TinyGPT(GPTConfig(**config))
            batch = lambda idx=idx: (idx[:, :-1], idx[:, 1:])
            step = (trainkit_variant(model, env, batch, lm_loss) if name.startswith("trainkit")
                    else deepspeed_variant(model, micro, batch, lm_loss))
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.steps * 3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            params = sum(p.numel() for p in model.parameters())
            print(f"{label} ({params / 1e9:.2f}B)  {name:<28}{statistics.median(times) * 1e3:>9.1f} ms  "
                  f"peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB", flush=True)
            del step, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    (gpu if args.gpu else cpu)(args)


if __name__ == "__main__":
    main()
