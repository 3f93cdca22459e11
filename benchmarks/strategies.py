"""trainkit's strategies beside their torch-native references, in one process tree, alternating.

Reference workload: 2 ranks, gloo, 1 thread each, an MLP of 4 blocks [512 -> 2048 -> 512],
batch 32 per rank, AdamW. Every variant builds the same model from the same seed and runs the same
step (forward, MSE loss, backward, gradient reduction, AdamW step, zero grad). Variants take turns in
rounds of ``--steps`` steps, the order rotating every round, so that drift in machine load hits all of
them alike; each round's mean step time is one sample and the median over rounds is reported, with
ratios against the references.

Scaling efficiency: one rank training its own share (batch 32, no communication) against two ranks
(batch 32 each): 1.0 means the second rank's data came for free. "2 ranks, no communication" runs the
same step on both ranks at once without any collective: its efficiency is the ceiling that sharing the
machine's cores and memory leaves to any strategy. Compressed communication (ddp with
PowerSGD at rank 1 and 4; 1-bit Adam under ddp) is timed after
its warm-up, in its compressed steady state. torch DDP's PowerSGD comm hook is not beside it: on gloo the
hook launches a bucket's Q all-reduce from a future callback on gloo's thread while backward launches the
next bucket's P all-reduce, so two ranks can issue them in different orders (seen here: "Received data size
doesn't match expected size", 9728 vs 2048 bytes, in the first compressed step).

    python benchmarks/strategies.py                 # reference workload (minutes)
    python benchmarks/strategies.py --smoke         # tiny model, seconds; what CI runs
    python benchmarks/strategies.py --only "trainkit ddp,torch DDP" --rounds 40   # two variants alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import targets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch import nn

from trainkit.optim import OneBitAdam
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm

Step = Callable[[], None]
TRAINKIT = ("ddp", "zero1", "zero2", "zero_offload", "fsdp", "zero3")
# (variant, the reference its ratio is printed against, second reference)
REPORT = [
    ("trainkit ddp", "torch DDP", None),
    ("trainkit zero1", targets.TORCH_ZERO, "trainkit ddp"),
    ("trainkit zero2", targets.TORCH_ZERO, "trainkit ddp"),
    ("trainkit zero_offload", targets.TORCH_ZERO, "trainkit ddp"),
    ("trainkit fsdp", targets.TORCH_FSDP2, "trainkit ddp"),
    ("trainkit zero3", targets.TORCH_FSDP2, "trainkit ddp"),
    ("trainkit ddp powersgd r1", "trainkit ddp", None),
    ("trainkit ddp powersgd r4", "trainkit ddp", None),
    ("trainkit ddp + 1-bit Adam", "trainkit ddp", None),
    ("trainkit pipeline GPipe", "torch pipelining GPipe", None),
    ("trainkit pipeline 1F1B", "torch pipelining 1F1B", None),
]


def make_model(width: int, hidden: int, blocks: int) -> nn.Module:
    """``blocks`` blocks of [width -> hidden -> width]; each block is a unit for FSDP-style sharding."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                           for _ in range(blocks)])


def trainkit_variant(name: str, options: dict, env: Environment, shape: tuple[int, int, int],
                     x: torch.Tensor, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
                     **optimizer_options: object) -> Step:
    model = make_model(*shape)
    strategy = get_strategy(name, **options)
    strategy.setup_environment(env)
    strategy.setup(model, optimizer(model.parameters(), lr=1e-4, **optimizer_options), Precision.from_name("32"))
    scale = 1.0 / strategy.world_size

    def step() -> None:
        with strategy.forward_context():
            loss = F.mse_loss(model(x), x)
        strategy.backward(loss)
        strategy.reduce_gradients(scale)
        strategy.optimizer_step()
        strategy.zero_grad()

    return step


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Step:
    """The step of the torch-native variants: forward, MSE, backward, AdamW, zero grads."""

    def step() -> None:
        F.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def torch_ddp_variant(shape: tuple[int, int, int], x: torch.Tensor, zero: bool = False) -> Step:
    """torch's DistributedDataParallel, with ZeroRedundancyOptimizer when ``zero``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(*shape))
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return plain_step(model, opt, x)


def torch_fsdp2_variant(shape: tuple[int, int, int], x: torch.Tensor) -> Step:
    """torch's FSDP2: ``fully_shard`` on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(*shape)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), x)


class PipelinedMLP(nn.Module):
    """The benchmark MLP as pipeline layers (its blocks) with an MSE loss against the input."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.blocks = make_model(*shape)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_loss(self, output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(output, batch[1])


def trainkit_pipeline_variant(schedule: str, env: Environment, shape: tuple[int, int, int], x: torch.Tensor,
                              microbatches: int) -> Step:
    module = PipelinedMLP(shape)
    strategy = get_strategy("pipeline", schedule=schedule, microbatches=microbatches)
    strategy.setup_environment(env)
    strategy.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-4), Precision.from_name("32"))

    def step() -> None:
        strategy.pipeline.run_schedule(module, (x, x), 1.0)  # every sample's loss weighted 1, normalised below
        strategy.reduce_gradients(1.0 / x.shape[0])
        strategy.optimizer_step()
        strategy.zero_grad()

    return step


def torch_pipelining_variant(schedule: str, rank: int, shape: tuple[int, int, int], x: torch.Tensor,
                             microbatches: int) -> Step:
    """torch.distributed.pipelining with the same split (half the blocks per stage) and micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    blocks = list(make_model(*shape))
    half = len(blocks) // 2
    stage_module = nn.Sequential(*(blocks[:half] if rank == 0 else blocks[half:]))
    # a process group of its own: torch's stage traffic (tag 0) never meets trainkit's ring collectives on the
    # default group (a rank ahead of its peer by one variant has mismatched them: "Received data size")
    group = dist.new_group([0, 1])
    stage = PipelineStage(stage_module, stage_index=rank, num_stages=2, device=torch.device("cpu"), group=group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = cls(stage, n_microbatches=microbatches, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

    def step() -> None:
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=x, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def local_variant(shape: tuple[int, int, int], x: torch.Tensor) -> Step:
    """One rank on its share with no communication: the scaling-efficiency baseline."""
    model = make_model(*shape)
    return plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), x)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=600)
    Comm.connect(env)  # one process group for trainkit's and torch's variants
    shape = (64, 128, 2) if args.smoke else (512, 2048, 4)
    batch = 8 if args.smoke else 32
    x = torch.randn(batch, shape[0], generator=torch.Generator().manual_seed(rank))
    build: dict[str, Callable[[], Step]] = {
        "torch DDP": lambda: torch_ddp_variant(shape, x),
        targets.TORCH_ZERO: lambda: torch_ddp_variant(shape, x, zero=True),
        targets.TORCH_FSDP2: lambda: torch_fsdp2_variant(shape, x),
    }
    build |= {f"trainkit {name}": lambda n=name: trainkit_variant(n, {}, env, shape, x) for name in TRAINKIT}
    for r in (1, 4):
        build[f"trainkit ddp powersgd r{r}"] = lambda r=r: trainkit_variant(
            "ddp", {"compression": "powersgd", "powersgd_rank": r, "powersgd_warmup_steps": 0}, env, shape, x)
    build["trainkit ddp + 1-bit Adam"] = lambda: trainkit_variant("ddp", {}, env, shape, x, OneBitAdam, freeze_step=1)
    build["2 ranks, no communication"] = lambda: local_variant(shape, x)  # what compute alone costs side by side
    microbatches = 2 if args.smoke else 4
    for schedule, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):  # one pipeline of 2 stages: the same batch
        build[f"trainkit pipeline {label}"] = lambda s=schedule: trainkit_pipeline_variant(s, env, shape, x,
                                                                                            microbatches)
        build[f"torch pipelining {label}"] = lambda s=schedule: torch_pipelining_variant(s, rank, shape, x,
                                                                                          microbatches)
    variants = {name: make() for name, make in build.items() if not args.only or name in args.only}
    times: dict[str, list[float]] = {name: [] for name in [*variants, "1 rank, its share"]}
    local = local_variant(shape, x) if rank == 0 and not args.only else None
    for step in variants.values():  # warm-up
        for _ in range(2):
            step()
        dist.barrier()  # a rank that is ahead must not start the next variant's point-to-point traffic early
    order = list(variants.items())
    for round_index in range(args.rounds):
        rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
        for name, step in rotated:  # rotate so no variant always runs right after the same neighbour
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
        dist.barrier()
        if local is not None:
            start = time.perf_counter()
            for _ in range(args.steps):
                local()
            times["1 rank, its share"].append((time.perf_counter() - start) / args.steps)
        dist.barrier()
    if rank == 0:
        out.update({name: statistics.median(ts) for name, ts in times.items() if ts})
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalisation, where c10d destructors have aborted a rank now and then


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model and few steps (CI)")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--only", type=lambda s: [n.strip() for n in s.split(",")], default=None,
                        help='comma-separated variants to time alone, e.g. "trainkit ddp,torch DDP"')
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 2, 2
    medians = run_ranks(_worker, 2, args)
    model = "2 x [64 -> 128 -> 64], batch 8" if args.smoke else "4 x [512 -> 2048 -> 512], batch 32"
    print(f"2 ranks, gloo, 1 thread each, MLP {model} per rank, AdamW; median of {args.rounds} rounds "
          f"x {args.steps} steps")
    width = max(len(n) for n in medians) + 2
    for name in ("torch DDP", targets.TORCH_ZERO, targets.TORCH_FSDP2,
                 "torch pipelining GPipe", "torch pipelining 1F1B"):
        if name in medians:
            print(f"{name:<{width}}{medians[name] * 1e3:>9.1f} ms")
    ratios: dict[tuple[str, str], float] = {}
    for name, ref, second in REPORT:
        if name not in medians or ref not in medians:
            continue
        second = second if second in medians else None
        ratios[(name, ref)] = medians[name] / medians[ref]
        line = f"{name:<{width}}{medians[name] * 1e3:>9.1f} ms   {ratios[(name, ref)]:.3f}x {ref}"
        if second:
            ratios[(name, second)] = medians[name] / medians[second]
            line += f", {ratios[(name, second)]:.3f}x {second}"
        print(line)
    verdict = [targets.SMOKE] if args.smoke else targets.verdict("loopback", ratios)
    if args.only:
        print("\n".join(verdict))
        return
    share, apart = medians["1 rank, its share"], medians["2 ranks, no communication"]
    print(f"{'1 rank, its share':<{width}}{share * 1e3:>9.1f} ms")
    print(f"{'2 ranks, no communication':<{width}}{apart * 1e3:>9.1f} ms   the most efficiency this machine allows: "
          f"{share / apart:.3f}")
    efficiency = ", ".join(f"{name} {share / medians[name]:.3f}" for name in (
        "trainkit ddp", "torch DDP", "trainkit ddp powersgd r1", "trainkit ddp powersgd r4",
        "trainkit ddp + 1-bit Adam"))
    print(f"scaling efficiency (1 rank / 2 ranks): {efficiency}")
    print("\n".join(verdict))


if __name__ == "__main__":
    main()
