"""Where a ddp step's time goes, trainkit's beside torch DDP's: the reference workload of ``strategies.py`` (2 ranks,
gloo, 1 thread each, 4 x [512 -> 2048 -> 512], batch 32 per rank, AdamW), each step timed by phase with a barrier
before it, the two taking turns; medians over rounds.

trainkit: forward, backward (bucket all-reduces launched as buckets fill), reduce_gradients (waiting for the last
buckets, scaling), the optimizer step, zero_grad. torch DDP: forward with backward (its all-reduces inside),
the optimizer step, zero_grad.

    python benchmarks/ddp_phases.py                 # about 30 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from strategies import make_model

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm


def _worker(rank: int, world: int, port: int, rounds: int, out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=600)
    Comm.connect(env)
    shape = (512, 2048, 4)
    x = torch.randn(32, shape[0], generator=torch.Generator().manual_seed(rank))
    reference = DistributedDataParallel(make_model(*shape))
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    model = make_model(*shape)
    strategy = get_strategy("ddp")
    strategy.setup_environment(env)
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), Precision.from_name("32"))
    times: dict[str, list[float]] = {}

    def timed(phases: list) -> None:
        last = time.perf_counter()
        for name, fn in phases:
            fn()
            now = time.perf_counter()
            times.setdefault(name, []).append(now - last)
            last = now

    def torch_step() -> None:
        timed([("torch DDP forward+backward", lambda: F.mse_loss(reference(x), x).backward()),
               ("torch DDP optimizer step", reference_opt.step),
               ("torch DDP zero_grad", lambda: reference_opt.zero_grad(set_to_none=True))])

    def trainkit_step() -> None:
        loss = []

        def forward() -> None:
            with strategy.forward_context():
                loss.append(F.mse_loss(model(x), x))

        timed([("trainkit forward", forward), ("trainkit backward", lambda: strategy.backward(loss[0])),
               ("trainkit reduce_gradients", lambda: strategy.reduce_gradients(1.0 / world)),
               ("trainkit optimizer step", strategy.optimizer_step), ("trainkit zero_grad", strategy.zero_grad)])

    for _ in range(3):
        torch_step()
        trainkit_step()
    times.clear()
    for r in range(rounds):
        for step in (torch_step, trainkit_step) if r % 2 else (trainkit_step, torch_step):
            dist.barrier()
            step()
    if rank == 0:
        out.update({name: statistics.median(ts) for name, ts in times.items()})
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    medians = run_ranks(_worker, 2, args.rounds)
    for name, value in medians.items():
        print(f"{name:<30}{value * 1e3:>8.2f} ms")
    for who in ("torch DDP", "trainkit"):
        total = sum(v for k, v in medians.items() if k.startswith(who))
        print(f"{who + ' step':<30}{total * 1e3:>8.2f} ms")


if __name__ == "__main__":
    main()
