"""trainkit's tensor parallelism (Megatron-LM, with and without sequence parallelism) beside torch's DTensor tensor
parallelism, on the same model with the same weights, in one process tree, alternating.

Reference workload: 2 ranks, gloo, 1 thread each, tp=2 (the two ranks are one tensor-parallel group and read the
same batch), the demo GPT (``trainkit.demo.gpt.DemoGPT``: 4 pre-norm blocks of width 512, 8 heads, fused q/k/v,
GELU MLP of 4 x width, vocabulary 2048 with the head tied to the token embedding), batch 4 x sequence 256, fp32,
AdamW. A step is forward, cross-entropy, backward, AdamW step, zero grad.

- trainkit: ``strategy="parallel"`` with ``tp=2`` (``sequence_parallel`` on and off), set up through the strategy as
  a run would be, with the demo's own ``tensor_parallel_plan()``: q/k/v, the MLP's first linear and the head split
  by columns (the head and the tied embedding by vocabulary, the loss computed without gathering the logits), the
  attention and MLP output projections by rows; under sequence parallelism norms, residuals and positions work on
  a rank's half of the sequence.
- torch DTensor: ``init_device_mesh("cpu", (2,))`` and ``parallelize_module`` with the same split:
  ``ColwiseParallel`` / ``RowwiseParallel`` on the block linears, ``RowwiseParallel`` on the embedding
  (vocabulary-parallel), ``ColwiseParallel(output_layouts=Shard(-1))`` on the head with ``loss_parallel()`` for the
  cross-entropy, the head re-tied to the embedding after parallelising. With sequence parallelism, torch's recipe
  (torchtitan's): ``SequenceParallel`` on the norms, ``PrepareModuleInput(Shard(1) -> Replicate())`` on attention
  and MLP, ``RowwiseParallel(output_layouts=Shard(1))`` on the output projections and the embedding, the positions
  cut to the rank's slice with ``PrepareModuleOutput(Replicate() -> Shard(0))``. DTensor shards a fused q/k/v
  weight in one contiguous block per rank, so its rows are permuted first (``[q, k, v]`` -> ``[q0, k0, v0, q1, k1,
  v1]``, what ``Colwise(parts=3)`` cuts), making each rank's block its heads' q, k and v: the same computation.

The losses of the first steps are compared across the two implementations (same weights, same batch), then the
variants take turns in rounds of ``--steps`` steps, the order rotating every round; each round's mean step time is
one sample and the median over rounds is reported, with ratios. The bytes trainkit's collectives moved in one step
(``Comm.stats`` of ``strategy.comms()``) are printed beside the formula of Megatron-LM (Shoeybi et al., 2019;
Korthikanti et al., 2022) for this model.

    python benchmarks/tensor_parallel.py            # reference workload (minutes)
    python benchmarks/tensor_parallel.py --smoke    # tiny model, seconds; what CI runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from trainkit.demo.gpt import DemoGPT
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm

Step = Callable[[], float]  # one training step; returns its loss
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
CHECKED = 3  # steps whose losses are compared across implementations (the first is step 0)
LR = 1e-3


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    seq: int
    batch: int

    def describe(self) -> str:
        return (f"demo GPT {self.n_layer} blocks x width {self.n_embd}, {self.n_head} heads, vocabulary {self.vocab} "
                f"(head tied), batch {self.batch} x sequence {self.seq}, fp32, AdamW")


SMOKE = Shape(n_layer=2, n_embd=64, n_head=4, vocab=128, seq=32, batch=2)
FULL = Shape(n_layer=4, n_embd=512, n_head=8, vocab=2048, seq=256, batch=4)
VARIANTS = [("trainkit tp=2 +SP", "torch DTensor tp=2 +SP"), ("trainkit tp=2", "torch DTensor tp=2")]


def make_gpt(shape: Shape) -> DemoGPT:
    torch.manual_seed(0)
    return DemoGPT(vocab_size=shape.vocab, block_size=shape.seq, n_layer=shape.n_layer, n_head=shape.n_head,
                   n_embd=shape.n_embd, dropout=0.0)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # as DemoGPT.training_step writes it


def trainkit_variant(sequence_parallel: bool, env: Environment, shape: Shape, x: torch.Tensor, y: torch.Tensor
                     ) -> tuple[Step, object]:
    module = make_gpt(shape)
    strategy = get_strategy("parallel", tp=2, sequence_parallel=sequence_parallel)
    strategy.setup_environment(env)
    strategy.setup(module, torch.optim.AdamW(module.parameters(), lr=LR), Precision.from_name("32"))

    def step() -> float:
        with strategy.forward_context():
            loss = lm_loss(module(x), y)
        strategy.backward(loss)
        strategy.reduce_gradients(1.0)  # one data-parallel coordinate: the mean loss is already the step's
        strategy.optimizer_step()
        strategy.zero_grad()
        return loss.item()

    return step, strategy


def dtensor_plan(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {
            "wte": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-parallel embedding: an all-reduce
            "blocks.*.attn.qkv": ColwiseParallel(),
            "blocks.*.attn.proj": RowwiseParallel(),
            "blocks.*.mlp.fc": ColwiseParallel(),
            "blocks.*.mlp.proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
        }
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # a reduce-scatter
        "wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),  # [seq, h] sliced
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn": gather,
        "blocks.*.attn.qkv": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.mlp": gather,
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def torch_dtensor_variant(sequence_parallel: bool, mesh: object, shape: Shape, x: torch.Tensor, y: torch.Tensor
                          ) -> Step:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    module = make_gpt(shape)
    gpt, tp = module.model, mesh.size()  # type: ignore[attr-defined]
    with torch.no_grad():
        for block in gpt.blocks:  # [q, k, v] -> [q0, k0, v0, q1, k1, v1]: rank r's contiguous block, its heads
            qkv = block.attn.qkv
            qkv.weight.copy_(qkv.weight.unflatten(0, (3, tp, -1)).transpose(0, 1).flatten(0, 2))
            qkv.bias.copy_(qkv.bias.unflatten(0, (3, tp, -1)).transpose(0, 1).flatten(0, 2))
            block.attn.n_head //= tp  # the forward reshapes its local q/k/v with this rank's heads
    parallelize_module(gpt, mesh, dtensor_plan(sequence_parallel))
    gpt.lm_head.weight = gpt.wte.weight  # parallelize_module gave each its own DTensor parameter: tie them again
    opt = torch.optim.AdamW(module.parameters(), lr=LR)

    def step() -> float:
        with loss_parallel():
            loss = lm_loss(module(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.to_local().item()

    return step


class CollectiveBytes(TorchDispatchMode):
    """Bytes of the functional collectives DTensor issues (forward and backward), counted as ``Comm.stats`` counts
    trainkit's: an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's whole input."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = dict.fromkeys(KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar the op first: its collectives then come back through here
        out = func(*args, **(kwargs or {}))
        ops = torch.ops._c10d_functional
        packet = func._overloadpacket
        counted = {ops.all_reduce: ("all_reduce", args[0]), ops.all_reduce_: ("all_reduce", args[0]),
                   ops.all_gather_into_tensor: ("all_gather", out),
                   ops.reduce_scatter_tensor: ("reduce_scatter", args[0])}.get(packet)
        if counted is not None:
            kind, tensor = counted
            self.bytes[kind] += tensor.numel() * tensor.element_size()
            self.calls[kind] += 1
        elif "c10d" in str(packet) and any(w in str(packet) for w in ("all_", "reduce", "gather", "scatter", "broad")):
            raise RuntimeError(f"a collective this count does not know: {packet}")
        return out


def megatron_bytes(shape: Shape, tp: int, sequence_parallel: bool) -> tuple[dict[str, int], str]:
    """What one step of the demo GPT moves under trainkit's Megatron-style tensor parallelism, in ``Comm.stats``'s
    units (payload bytes: an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's whole input),
    and how the sum is made."""
    b, s, h, n_layer = shape.batch, shape.seq, shape.n_embd, shape.n_layer
    e = b * s * h * 4  # one activation [b, s, h] in fp32
    loss = 4 * b * s * 4  # vocabulary-parallel cross-entropy: all-reduces of the max and of 3 sums per position
    if not sequence_parallel:
        return ({"all_reduce": (4 * n_layer + 2) * e + loss, "all_gather": 0, "reduce_scatter": 0},
                "all_reduce = L x 4E (Megatron: 2 forward + 2 backward per block) + E (embedding, forward) "
                "+ E (head's input, backward) + 16bs (loss: 4 fp32 per position)")
    replicated = ((4 * n_layer + 2) * h + 2 * n_layer * h + s * h) * 4  # norms, row-parallel biases, positions
    return ({"all_reduce": loss + replicated, "all_gather": (6 * n_layer + 3) * e,
             "reduce_scatter": (4 * n_layer + 2) * e},
            "all_gather = L x 6E (Korthikanti: 2 forward + 2 backward per block, + 2 in backward re-gathering the "
            "input a column-parallel layer saved as its slice) + E (embedding, backward) + 2E (head: forward, and "
            "its re-gather); reduce_scatter = L x 4E (2 forward + 2 backward per block) + E (embedding, forward) + E "
            "(head's input, backward); all_reduce = 16bs (loss) + 4 x (replicated parameters: norms, row-parallel "
            "biases, positions: their gradients are partial sums over the sequence)")


def comm_list(strategy: object) -> list[Comm]:
    return list({id(c): c for c in strategy.comms()}.values())  # type: ignore[attr-defined]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=600)
    Comm.connect(env)  # one process group for trainkit's and torch's variants
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    shape = SMOKE if args.smoke else FULL
    gen = torch.Generator().manual_seed(1)  # one tensor-parallel group: every rank reads the same batch
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen)
    variants: dict[str, Step] = {}
    strategies: dict[str, object] = {}
    for (ours, theirs), sp in zip(VARIANTS, (True, False), strict=True):
        variants[ours], strategies[ours] = trainkit_variant(sp, env, shape, x, y)
        variants[theirs] = torch_dtensor_variant(sp, mesh, shape, x, y)
    losses: dict[str, list[float]] = {name: [] for name in variants}
    moved: dict[str, dict[str, int]] = {}
    calls: dict[str, dict[str, int]] = {}
    for name, step in variants.items():  # warm-up: the steps whose losses are compared
        for index in range(CHECKED):
            comms = comm_list(strategies[name]) if name in strategies else []
            for comm in comms:
                comm.stats.reset()
            losses[name].append(step())
            if index == 1 and comms:  # a step past the first: what every step moves
                moved[name] = {kind: sum(c.stats.bytes.get(kind, 0) for c in comms) for kind in KINDS}
        dist.barrier()
    for name, step in variants.items():  # DTensor's collectives, counted in one more step
        if name not in strategies:
            with CollectiveBytes() as counter:
                step()
            moved[name] = counter.bytes
            calls[name] = counter.calls
        else:
            calls[name] = {kind: sum(c.stats.calls.get(kind, 0) for c in comm_list(strategies[name]))
                           for kind in KINDS}
        dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_index in range(args.rounds):
        rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
        for name, step in rotated:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, losses)
    if rank == 0:
        out["medians"] = {name: statistics.median(ts) for name, ts in times.items()}
        out["losses"] = everyone
        out["moved"], out["calls"] = moved, calls
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalisation, where c10d destructors have aborted a rank now and then


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model and few steps (CI)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 2, 2
    shape = SMOKE if args.smoke else FULL
    out = run_ranks(_worker, 2, args)
    medians, moved, calls, losses = dict(out["medians"]), dict(out["moved"]), dict(out["calls"]), list(out["losses"])
    print(f"2 ranks, gloo, 1 thread each, tp=2; {shape.describe()}; median of {args.rounds} rounds x {args.steps} "
          "steps")
    print("compared: the whole model tensor-parallel in both (vocabulary-parallel embedding and tied head, "
          "loss without gathering the logits, q/k/v and MLP in by columns, projections out by rows; with SP "
          "norms, residuals and positions on half the sequence); DTensor's fused q/k/v rows permuted so its "
          "contiguous shard is a rank's heads")
    width = max(len(n) for n in medians) + 2
    for ours, theirs in VARIANTS:
        for name in (ours, theirs):
            print(f"{name:<{width}}{medians[name] * 1e3:>9.1f} ms")
    for ours, theirs in VARIANTS:
        print(f"ratio trainkit / torch DTensor, {ours.removeprefix('trainkit ')}: "
              f"{medians[ours] / medians[theirs]:.3f}   ({ours} vs {theirs})")
    for ours, theirs in VARIANTS:
        diffs = [abs(a - b) for rank_losses in losses for a, b in zip(rank_losses[ours], rank_losses[theirs],
                                                                        strict=True)]
        step0 = max(abs(r[ours][0] - r[theirs][0]) for r in losses)
        print(f"loss {ours} vs torch DTensor: step 0 {losses[0][ours][0]:.6f} vs {losses[0][theirs][0]:.6f}, max abs "
              f"difference {step0:.2e} at step 0, {max(diffs):.2e} over the first {CHECKED} steps (both ranks)")
    e = shape.batch * shape.seq * shape.n_embd * 4
    print(f"bytes per step on one rank, payload as trainkit's Comm.stats counts it (an all-reduce: its tensor; an "
          f"all-gather: the gathered output; a reduce-scatter: the whole input; on a ring a rank sends 2(t-1)/t of an "
          f"all-reduce's payload and (t-1)/t of the others'), DTensor's functional collectives counted alike; "
          f"E = b*s*h*4 = {shape.batch}*{shape.seq}*{shape.n_embd}*4 = {e} bytes, L = {shape.n_layer} blocks; "
          "volume: all-reduce counted twice (= reduce-scatter + all-gather)")
    print(f"{'':<{width}}" + "".join(f"{kind + ' (calls)':>26}" for kind in KINDS) + f"{'volume':>14}")
    for ours, theirs in VARIANTS:
        formula, _ = megatron_bytes(shape, 2, "+SP" in ours)
        rows = [(ours, moved[ours], calls[ours]), (theirs, moved[theirs], calls[theirs]), ("formula", formula, None)]
        for name, counted, n in rows:
            cells = "".join(f"{counted[kind]:>18} ({n[kind]:>4})" if n else f"{counted[kind]:>25} " for kind in KINDS)
            volume = sum(counted[kind] * (2 if kind == "all_reduce" else 1) for kind in KINDS)
            print(f"{name:<{width}}{cells}{volume:>14}")
    for ours, _ in VARIANTS:
        formula, how = megatron_bytes(shape, 2, "+SP" in ours)
        print(f"formula, {ours}: {how}")
        for kind in KINDS:
            agree = "agree" if moved[ours][kind] == formula[kind] else "DIFFER"
            print(f"byte check: {ours} {kind} measured={moved[ours][kind]} formula={formula[kind]} {agree}")
    volume = {name: sum(moved[name][kind] * (2 if kind == "all_reduce" else 1) for kind in KINDS) for name in moved}
    plain, sp = (ours for ours, _ in VARIANTS[::-1])
    print(f"Megatron per block: 2 all-reduces of E forward + 2 backward, volume 8E; with sequence parallelism 2 "
          f"all-gathers + 2 reduce-scatters each way, the same 8E, plus 2E re-gathered in backward: the blocks' "
          f"{8 * e * shape.n_layer} of {plain}'s volume {volume[plain]}, {10 * e * shape.n_layer} of {sp}'s "
          f"{volume[sp]}")

if __name__ == "__main__":
    main()
