"""trainkit's pipeline schedules beside torch.distributed.pipelining's, in one process tree, alternating.

One pipeline of ``--world`` stages (default 2; 4 where the machine has the cores), gloo, 1 thread per rank, an
MLP of 2 blocks [512 -> 2048 -> 512] per stage (4 blocks at 2 stages, 8 at 4), batch 32, 2 x stages micro-batches,
AdamW. Pairs, each against its torch counterpart with the same split:

- 1F1B: one block group per rank (``Schedule1F1B``);
- interleaved 1F1B: 2 chunks per rank, chunk ``c`` of rank ``r`` is virtual stage ``c * stages + r``
  (``ScheduleInterleaved1F1B`` with 2 local stages);
- zero-bubble: ZB-H1, one chunk per rank, backward split into B and W (``ScheduleInterleavedZeroBubble`` with
  one local stage, torch's ZB1P).

Variants take turns in rounds of ``--steps`` steps, the order rotating every round; the median of the rounds'
mean step times is reported, with ratios. For trainkit's schedules the bubble is also measured: each rank's
time blocked on a peer inside the schedule over the schedule's length, averaged over ranks, beside what
``schedules.simulate`` gives for the same schedule (forward 1, input gradient 1, weight gradient 1; no
communication cost).

    python benchmarks/pipeline_schedules.py               # 2 stages (minutes)
    python benchmarks/pipeline_schedules.py --world 4     # 4 stages
    python benchmarks/pipeline_schedules.py --smoke       # tiny, seconds; what CI runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch import nn

from trainkit_strategies import Environment, Precision, RunsSchedule, capability, get_strategy
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.pipeline.schedules import SCHEDULES, simulate

Step = Callable[[], None]
PAIRS = [("1f1b", 1, "Schedule1F1B"), ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B"),
         ("zero_bubble", 1, "ScheduleInterleavedZeroBubble")]


def blocks(width: int, hidden: int, count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(count)]


class PipelinedMLP(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*layers)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_loss(self, output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(output, batch[1])


def trainkit_variant(schedule: str, chunks: int, env: Environment, shape: tuple[int, int, int], x: torch.Tensor,
                     microbatches: int) -> tuple[Step, object]:
    module = PipelinedMLP(blocks(*shape))
    strategy = get_strategy("pipeline", schedule=schedule, microbatches=microbatches, virtual_stages=chunks)
    strategy.setup_environment(env)
    strategy.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-4), Precision.from_name("32"))

    def step() -> None:
        strategy.pipeline.run_schedule(module, (x, x), 1.0)
        strategy.reduce_gradients(1.0 / x.shape[0])
        strategy.optimizer_step()
        strategy.zero_grad()

    return step, strategy


def torch_variant(cls_name: str, chunks: int, rank: int, world: int, shape: tuple[int, int, int], x: torch.Tensor,
                  microbatches: int) -> Step:
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    layers = blocks(*shape)
    per = len(layers) // (world * chunks)
    stages, params = [], []
    for c in range(chunks):
        index = c * world + rank
        module = nn.Sequential(*layers[index * per : (index + 1) * per])
        params += list(module.parameters())
        stages.append(PipelineStage(module, stage_index=index, num_stages=world * chunks, device=torch.device("cpu")))
    cls = getattr(pipelining, cls_name)
    runner = cls(stages[0] if cls_name == "Schedule1F1B" else stages, n_microbatches=microbatches, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(params, lr=1e-4)
    first, last = rank == 0, rank == world - 1

    def step() -> None:
        if first and last:
            runner.step(x, target=x, losses=[])
        elif first:
            runner.step(x)
        elif last:
            runner.step(target=x, losses=[])
        else:
            runner.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=600)
    Comm.connect(env)
    shape = (64, 128, 2 * world) if args.smoke else (512, 2048, 2 * world)
    batch = 8 if args.smoke else 32
    microbatches = 2 * world
    x = torch.randn(batch, shape[0], generator=torch.Generator().manual_seed(0))  # one pipeline: the same batch
    variants: dict[str, Step] = {}
    strategies: dict[str, object] = {}
    for schedule, chunks, torch_cls in PAIRS:
        variants[f"trainkit {schedule}"], strategies[schedule] = trainkit_variant(schedule, chunks, env, shape, x,
                                                                                   microbatches)
        variants[f"torch {torch_cls}"] = torch_variant(torch_cls, chunks, rank, world, shape, x, microbatches)
    times: dict[str, list[float]] = {name: [] for name in variants}
    idle: dict[str, list[float]] = {schedule: [] for schedule in strategies}
    for step in variants.values():  # warm-up
        for _ in range(2):
            step()
    order = list(variants.items())
    for round_index in range(args.rounds):
        rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
        for name, step in rotated:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
                schedule = name.removeprefix("trainkit ")
                if schedule in strategies:
                    spent = capability(strategies[schedule], RunsSchedule).idle  # type: ignore[union-attr]
                    idle[schedule].append(spent["wait_s"] / spent["schedule_s"])
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    bubbles = {schedule: statistics.median(values) for schedule, values in idle.items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, bubbles)
    if rank == 0:
        out["medians"] = medians
        out["bubbles"] = {s: statistics.mean(b[s] for b in everyone) for s in bubbles}
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model and few steps (CI)")
    parser.add_argument("--world", type=int, default=2, help="pipeline stages (ranks)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 2, 2
    out = run_ranks(_worker, args.world, args)
    medians, bubbles = dict(out["medians"]), dict(out["bubbles"])
    p, m = args.world, 2 * args.world
    width = "64 -> 128 -> 64" if args.smoke else "512 -> 2048 -> 512"
    print(f"{p} stages, gloo, 1 thread per rank ({os.cpu_count()} cores), MLP {2 * p} x [{width}], batch "
          f"{8 if args.smoke else 32}, {m} micro-batches, AdamW; median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'schedule':<20}{'trainkit':>10}{'torch':>10}{'ratio':>8}{'bubble':>9}{'simulated':>11}")
    for schedule, chunks, torch_cls in PAIRS:
        ours, theirs = medians[f"trainkit {schedule}"], medians[f"torch {torch_cls}"]
        split = schedule == "zero_bubble"
        _, simulated = simulate(SCHEDULES[schedule](p, m, chunks), 1 / chunks, (1 if split else 2) / chunks,
                                1 / chunks)
        print(f"{schedule:<20}{ours * 1e3:>8.1f}ms{theirs * 1e3:>8.1f}ms{ours / theirs:>8.3f}"
              f"{bubbles[schedule]:>9.3f}{simulated:>11.3f}   vs torch {torch_cls}")


if __name__ == "__main__":
    main()
