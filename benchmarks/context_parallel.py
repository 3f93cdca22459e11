"""Context parallelism at a sequence length where attention dominates: cp=2 on 2 ranks against one process.

Reference workload: the demo GPT (``trainkit.demo.gpt.DemoGPT``: 2 pre-norm blocks of width 128, 4 heads, vocabulary
256), one sequence of 8192 tokens, causal, fp32, AdamW. A step is forward, cross-entropy, backward, AdamW step,
zero grad, through the strategy as a run takes it. At this length a block's attention (about 2s^2h multiply-adds
forward under the causal mask) is about 5x its linear layers' (12sh^2).

- single: ``strategy="single"`` on one rank, one thread (the other rank waits).
- cp=2 ring: ``strategy="parallel"`` with ``cp=2``: each rank holds chunks r and 3 - r of the sequence's 4, keys and
  values pass around the ring while the block in hand is used.
- cp=2 all-gather: the same with ``cp_method="all_gather"`` (Llama 3's choice): keys and values gathered whole first.
- cp=2 ulysses: ``cp_method="ulysses"`` (DeepSpeed-Ulysses): an all-to-all gives each rank the whole sequence for
  half the heads, attention runs locally, a second all-to-all gives the tokens back.

2 ranks on gloo, one thread each; the variants take turns in rounds, the order rotating; the median of each
round's mean step is reported, with cp's time as a fraction of single's (target: at most 0.75) and the attention
work per rank (chunk pairs of scores, counted as the code computes them; equal on both ranks).

    python benchmarks/context_parallel.py            # reference workload (a few minutes)
    python benchmarks/context_parallel.py --smoke    # tiny, seconds; what CI runs
    python benchmarks/context_parallel.py --memory 16384   # activations per rank of a 124M GPT, cp x checkpointing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from ranks import run_ranks

from trainkit.demo.gpt import DemoGPT
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm

VARIANTS = ("single", "cp=2 ring", "cp=2 all-gather", "cp=2 ulysses")
METHOD = {"cp=2 ring": "ring", "cp=2 all-gather": "all_gather", "cp=2 ulysses": "ulysses"}


def build(name: str, env: Environment, args: argparse.Namespace):
    torch.manual_seed(0)
    model = DemoGPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    if name == "single":
        strategy = get_strategy("single")
        strategy.setup_environment(Environment(device=env.device, rank=0, local_rank=0, world_size=1))
    else:
        strategy = get_strategy("parallel", cp=2, cp_method=METHOD[name])
        strategy.setup_environment(env)
    strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), Precision.from_name("32"))
    return model, strategy


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=600)
    Comm.connect(env)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, args.vocab, (1, args.seq), generator=gen),
             torch.randint(0, args.vocab, (1, args.seq), generator=gen))
    runs = {name: build(name, env, args) for name in VARIANTS if name != "single" or rank == 0}

    def step(name: str) -> float:
        model, strategy = runs[name]
        local = strategy.local_batch(batch)
        with strategy.forward_context():
            loss = model.training_step(local, 0)["loss"]
        strategy.backward(loss)
        strategy.reduce_gradients(1.0 / strategy.item_ranks)  # the mean over the ranks' equal token counts
        strategy.optimizer_step()
        strategy.zero_grad()
        return loss.item()

    losses = {}
    for name in VARIANTS:  # warm-up, and the first step's loss
        if name in runs:
            losses[name] = step(name)
        dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            dist.barrier()
            start = time.perf_counter()
            if name in runs:
                for _ in range(args.steps):
                    step(name)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
    cp_axis = next(a for a in runs["cp=2 ring"][1].axes if a.name == "cp")
    work = cp_axis.parallel.work  # chunk pairs of the ring's forwards so far, this rank
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (losses, work))
    if rank == 0:
        out["medians"] = {name: statistics.median(ts) for name, ts in times.items()}
        out["everyone"] = everyone
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def memory_table(seq: int, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50304) -> str:
    """Activations per rank (bytes autograd saves in one forward, ``ActivationMeter``) of a long-sequence demo GPT,
    traced with fake CPU tensors (the CPU's kernels, no memory used): context parallelism of 1 to 8 times no,
    selective and full checkpointing. A rank's forward is traced as it runs: its two chunks of the sequence,
    attention across a planning communicator that counts and moves nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainkit.activation import apply_activation_checkpointing
    from trainkit_strategies import ActivationMeter
    from trainkit_strategies.axis import install
    from trainkit_strategies.communication.plan_comm import PlanComm
    from trainkit_strategies.context.ring import CONTEXT, ContextParallel, shard_sequence

    rows = []
    for cp in (1, 2, 4, 8):
        cells = []
        for mode in (None, "selective", "full"):
            with torch.device("meta"):
                model = DemoGPT(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width)
            if mode:
                apply_activation_checkpointing(model, mode)
            with FakeTensorMode(allow_non_fake_inputs=True):  # CPU tensors without memory: the CPU's kernels
                model.to_empty(device="cpu")
                batch = tuple(shard_sequence(torch.zeros(1, seq, dtype=torch.long), 0, cp) for _ in range(2))
                group = ContextParallel(PlanComm(cp, 0, torch.device("cpu"))) if cp > 1 else None
                install(model, CONTEXT, group)  # what the cp axis's transform does
                with ActivationMeter(exclude=model.parameters()) as meter:
                    model.training_step(batch, 0)
            cells.append(meter.bytes)
        rows.append((cp, cells))
    lines = [f"demo GPT {layers} blocks x width {width}, {heads} heads, vocabulary {vocab}, one sequence of {seq} "
             "tokens, fp32; activations per rank (GB = 1e9 bytes)", "",
             "| cp | none | selective | full | none / single's |", "|---|---|---|---|---|"]
    single = rows[0][1][0]
    for cp, cells in rows:
        lines.append(f"| {cp} | " + " | ".join(f"{c / 1e9:.2f} GB" for c in cells) + f" | {cells[0] / single:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--memory", type=int, metavar="SEQ", help="print the activations per rank of a 124M demo "
                        "GPT at this sequence length under cp and each checkpointing mode (fake tensors), and exit")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if args.memory:
        print(memory_table(args.memory))
        return
    vars(args).update(layers=2, width=128, heads=4, vocab=256)
    if args.smoke:
        args.seq, args.width, args.rounds, args.steps = 256, 32, 2, 1
    out = run_ranks(_worker, 2, args)
    medians, everyone = out["medians"], out["everyone"]
    single = medians["single"]
    print(f"demo GPT {args.layers} blocks x width {args.width}, {args.heads} heads, vocabulary {args.vocab}, one "
          f"sequence of {args.seq} tokens, causal, fp32, AdamW; 2 ranks on gloo, 1 thread each; median of "
          f"{args.rounds} rounds x {args.steps} steps")
    for name in VARIANTS:
        ratio = "" if name == "single" else f"   {medians[name] / single:.3f} x single (target <= 0.75)"
        print(f"{name:<18}{medians[name] * 1e3:>10.1f} ms{ratio}")
    print(f"first-step loss: single {everyone[0][0]['single']:.6f}, cp=2 ring rank 0 {everyone[0][0]['cp=2 ring']:.6f}"
          f" / rank 1 {everyone[1][0]['cp=2 ring']:.6f} (each rank's mean over its half of the tokens)")
    print(f"attention work per rank (chunk pairs of scores, ring forwards): {[e[1] for e in everyone]}")


if __name__ == "__main__":
    main()
