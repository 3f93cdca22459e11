"""Expert parallelism at ep=2 on gloo against a reference written with torch's own ``all_to_all_single`` and plain
loops over the experts: the same model, batch and optimizer, the same step.

Reference workload: token embeddings, 2 mixture-of-experts layers (pre-norm, residual; width 256, 8 SwiGLU experts
of hidden 512, top 2 of a softmax router, dropless, the sequence-wise balance loss at 0.01 and the router z-loss at
0.001), a head and cross-entropy over a vocabulary of 256; 8 sequences of 256 tokens per rank; AdamW; fp32.

- trainkit ep=2: ``strategy="parallel"`` with ``ep=2`` on a module built from ``trainkit.moe.MoE``.
- torch reference: the same layers written out: counts all-gathered, tokens to their experts and back with
  ``torch.distributed.all_to_all_single`` (inside an autograd function whose backward sends the gradients back), the
  experts in a Python loop, the dense gradients summed in one all-reduce.

2 ranks on gloo, one thread each; the variants take turns in rounds, the order alternating; the median of each
round's mean step is reported, with trainkit's time as a fraction of the reference's (target: at most 1.0), and the
first step's loss of each (equal up to rounding: the same model from the same seed).

    python benchmarks/experts.py            # reference workload (about a minute)
    python benchmarks/experts.py --smoke    # tiny, seconds; what CI runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch import Tensor, nn

from trainkit.moe import MoE
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.experts.auxiliary import collecting, with_auxiliary

VARIANTS = ("trainkit ep=2", "torch reference")


class Model(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.norms = nn.ModuleList(nn.RMSNorm(args.dim) for _ in range(args.layers))
        self.moes = nn.ModuleList(MoE(args.dim, args.hidden, args.experts, top_k=2, balance_coef=0.01, z_coef=0.001)
                                  for _ in range(args.layers))
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            h = h + moe(norm(h))
        return self.head(h)


# -- the reference: torch's all_to_all_single and loops ----------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, received: list[int], sent: list[int]) -> Tensor:
        ctx.received, ctx.sent = received, sent
        out = x.new_empty((sum(received), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), received, sent)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        out = grad.new_empty((sum(ctx.sent), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.received)
        return out, None, None


def reference_moe(moe: MoE, x: Tensor, world: int, rank: int) -> tuple[Tensor, Tensor]:
    """``moe``'s layer written out with torch's collectives (its weights: this rank's experts); output, aux loss."""
    b, s, d = x.shape
    tokens = x.reshape(-1, d)
    logits = tokens @ moe.router.weight.t()
    probs = logits.softmax(-1)
    top, experts = probs.topk(moe.top_k, -1)
    weights = top / top.sum(-1, keepdim=True)
    num = moe.num_experts
    counts_seq = F.one_hot(experts.view(b, s * moe.top_k), num).sum(1).float()  # per sequence, for the balance
    balance = num * (counts_seq / (moe.top_k * s) * probs.view(b, s, num).mean(1)).sum(-1).mean()
    aux = 0.01 * balance + 0.001 * torch.logsumexp(logits, -1).square().mean()
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    token = torch.arange(tokens.shape[0]).repeat_interleave(moe.top_k)[order]
    counts = torch.bincount(flat, minlength=num)
    table = torch.empty(world * num, dtype=counts.dtype)
    dist.all_gather_into_tensor(table, counts)
    table = table.view(world, num).tolist()
    local = num // world
    sent = [sum(table[rank][j * local:(j + 1) * local]) for j in range(world)]
    mine = [row[rank * local:(rank + 1) * local] for row in table]
    received = [sum(r) for r in mine]
    arrived = _AllToAll.apply(tokens[token], received, sent)
    pieces = [[] for _ in range(local)]  # rows by local expert, from each source in turn
    offset = 0
    for row in mine:
        for e, n in enumerate(row):
            pieces[e].append((offset, n))
            offset += n
    out = torch.empty_like(arrived)
    for e in range(local):
        index = torch.cat([torch.arange(o, o + n) for o, n in pieces[e]]) if pieces[e] else torch.zeros(0, dtype=int)
        rows = arrived[index]
        out = out.index_copy(0, index, (F.silu(rows @ moe.w1[e]) * (rows @ moe.w3[e])) @ moe.w2[e])
    back = _AllToAll.apply(out, sent, received)
    combined = torch.zeros_like(tokens).index_add(0, token, back * weights.reshape(-1)[order].unsqueeze(-1))
    return combined.view(b, s, d), aux


class Reference:
    """The model stepped by hand: this rank's experts, dense gradients all-reduced in one buffer, AdamW."""

    def __init__(self, args: argparse.Namespace, world: int, rank: int) -> None:
        self.model, self.world, self.rank = Model(args), world, rank
        local = args.experts // world
        for moe in self.model.moes:
            for name in ("w1", "w3", "w2"):
                getattr(moe, name).data = getattr(moe, name).data[rank * local:(rank + 1) * local].clone()
        self.experts = {id(getattr(m, n)) for m in self.model.moes for n in ("w1", "w3", "w2")}
        self.dense = [p for p in self.model.parameters() if id(p) not in self.experts]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, batch: tuple[Tensor, Tensor]) -> float:
        x, y = batch
        h, aux = self.model.embed(x), 0.0
        for norm, moe in zip(self.model.norms, self.model.moes, strict=True):
            out, layer_aux = reference_moe(moe, norm(h), self.world, self.rank)
            h, aux = h + out, aux + layer_aux
        loss = F.cross_entropy(self.model.head(h).flatten(0, 1), y.flatten())
        ((loss + aux) / self.world).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.dense])
        dist.all_reduce(flat)
        offset = 0
        for p in self.dense:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss)


class Trainkit:
    def __init__(self, args: argparse.Namespace, env: Environment) -> None:
        self.model = Model(args)
        self.strategy = get_strategy("parallel", ep=2)
        self.strategy.setup_environment(env)
        self.strategy.setup(self.model, torch.optim.AdamW(self.model.parameters(), lr=1e-4), Precision.from_name("32"))

    def step(self, batch: tuple[Tensor, Tensor]) -> float:
        x, y = batch
        strategy = self.strategy
        with strategy.forward_context(), collecting(self.model) as aux:
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        strategy.backward(with_auxiliary(loss, aux))
        strategy.reduce_gradients(1.0 / strategy.item_ranks)
        strategy.optimizer_step()
        strategy.zero_grad()
        return float(loss)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=600)
    Comm.connect(env)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    runs = {"trainkit ep=2": Trainkit(args, env), "torch reference": Reference(args, world, rank)}
    first = {name: run.step(batch) for name, run in runs.items()}  # warm-up, and the first step's loss
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                runs[name].step(batch)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        out["medians"] = {name: statistics.median(ts) for name, ts in times.items()}
        out["first"] = first
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    vars(args).update(vocab=256, dim=256, hidden=512, experts=8, layers=2, batch=8, seq=256)
    if args.smoke:
        vars(args).update(dim=32, hidden=32, experts=4, batch=2, seq=16, rounds=2, steps=1)
    out = run_ranks(_worker, 2, args)
    medians, first = out["medians"], out["first"]
    print(f"{args.layers} MoE layers of {args.experts} experts (width {args.dim}, hidden {args.hidden}, top 2), "
          f"vocabulary {args.vocab}, {args.batch} x {args.seq} tokens per rank, fp32, AdamW; 2 ranks on gloo, "
          f"1 thread each; median of {args.rounds} rounds x {args.steps} steps")
    reference = medians["torch reference"]
    for name in VARIANTS:
        ratio = f"   {medians[name] / reference:.3f} x reference (target <= 1.0)" if name != "torch reference" else ""
        print(f"{name:<18}{medians[name] * 1e3:>10.1f} ms{ratio}")
    print(f"first-step loss (rank 0): trainkit {first['trainkit ep=2']:.6f}, reference {first['torch reference']:.6f}")


if __name__ == "__main__":
    main()
