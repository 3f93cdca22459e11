"""Every strategy across a network link: step time, bytes on the link, and efficiency against one rank alone.

Over loopback moving a byte costs about what computing with it does; between nodes it does not. This runs the
reference workload of ``strategies.py`` (an MLP of 4 blocks [512 -> 2048 -> 512], 8.4M parameters, batch 32 per
rank, AdamW, gloo, 1 thread per rank) with the ranks on two "nodes" joined by a link shaped to a given rate:

- ``2x1``: one rank per node, every strategy and its torch-native reference (DDP, FSDP2; DeepSpeed when installed).
- ``cp``: one rank per node, context parallelism of the demo GPT on one long sequence (cp=2 with ring, all-gather and
  Ulysses attention) against one rank's step on the whole sequence.
- ``2x2``: two ranks per node (the node's own traffic on loopback, the link between nodes) for the layouts that
  care where their traffic goes: ddp and fsdp over all 4 ranks against HSDP (shard inside a node, replicate across)
  and a pipeline whose two stages sit on the two nodes (data parallel inside each).

On Linux as root the script builds the link itself (``../shared``-style netsim: two network namespaces joined by a
veth pair, each direction shaped with ``tc ... tbf``; ``--netsim`` names the script) and runs one rank group per
namespace; otherwise it says so and stops. On a real cluster the same worker runs under torchrun on every node:

    python benchmarks/link.py                                   # 1 and 10 Gb/s, 2x1 and 2x2 (as root; minutes)
    python benchmarks/link.py --rates 1gbit --layouts 2x1 --rounds 5
    python benchmarks/link.py --rates 1gbit --layouts 2x1 --only "trainkit ddp,1 rank,no comm"   # some rows
    python benchmarks/link.py --smoke                           # tiny model over loopback, no link (CI)
    torchrun --nnodes 2 --nproc-per-node 1 ... benchmarks/link.py --worker --rate-gbit 100   # real nodes

Columns: the median step time over rounds (variants take turns, the order rotating each round); the bytes the node
sent on the link per step, read from the interface's own counters (``/proc/net/dev``: payload plus TCP/IP
headers; "-" where the interface is not known: set GLOO_SOCKET_IFNAME);
the bandwidth bound, the link's bytes at the shaped rate (no step can be faster than max(compute, bound), none
need be slower than compute + bound: "+ alone"); and efficiency, one rank's step on its share alone over the
variant's step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import strategies
import targets
from strategies import (
    PipelinedMLP,
    Step,
    local_variant,
    make_model,
    torch_ddp_variant,
    torch_fsdp2_variant,
)

from trainkit.optim import OneBitAdam
from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.communication.comm import Comm

ROOT = Path(__file__).resolve().parents[1]
NETSIM = ROOT.parent / "shared" / "tools" / "netsim.sh"
NODE_ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}
ALONE = "1 rank, its share"
APART = "ranks, no communication"


# -- variants ------------------------------------------------------------------------------------------------------
class Variant:
    """One way of training the model: one step of it."""

    def __init__(self, step: Step) -> None:
        self.step = step


def trainkit_variant(name: str, options: dict, env: Environment, shape: tuple[int, int, int], x: torch.Tensor,
                     optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
                     **optimizer_options: object) -> Variant:
    return Variant(strategies.trainkit_variant(name, options, env, shape, x, optimizer, **optimizer_options))


def pipeline_variant(options: dict, env: Environment, shape: tuple[int, int, int], x: torch.Tensor,
                     microbatches: int) -> Variant:
    """Two stages of half the blocks each (``parallel`` with ``pp=2``, the rest of the world replicas)."""
    module = PipelinedMLP(shape)
    strategy = get_strategy("parallel", pp=2, schedule="1f1b", microbatches=microbatches, **options)
    strategy.setup_environment(env)
    strategy.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-4), Precision.from_name("32"))

    def step() -> None:
        strategy.pipeline.run_schedule(module, (x, x), 1.0)
        strategy.reduce_gradients(1.0 / (x.shape[0] * env.world_size // 2))  # samples of the global batch
        strategy.optimizer_step()
        strategy.zero_grad()

    return Variant(step)


def deepspeed_variant(stage: int, shape: tuple[int, int, int], x: torch.Tensor) -> Variant | None:
    try:
        import deepspeed
    except ImportError:
        return None
    model = make_model(*shape)
    config = {"train_micro_batch_size_per_gpu": x.shape[0], "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step() -> None:
        loss = F.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()

    return Variant(step)


def variants_2x1(env: Environment, shape: tuple[int, int, int], x: torch.Tensor, microbatches: int
                 ) -> dict[str, Variant]:
    v: dict[str, Variant] = {
        "torch DDP": Variant(torch_ddp_variant(shape, x)),
        targets.LINK_FSDP2: Variant(torch_fsdp2_variant(shape, x)),
    }
    for name in ("ddp", "zero1", "zero2", "zero_offload", "fsdp", "zero3"):
        v[f"trainkit {name}"] = trainkit_variant(name, {}, env, shape, x)
    for r in (1, 4):
        v[f"trainkit ddp powersgd r{r}"] = trainkit_variant(
            "ddp", {"compression": "powersgd", "powersgd_rank": r, "powersgd_warmup_steps": 0}, env, shape, x)
    v["trainkit ddp + 1-bit Adam"] = trainkit_variant("ddp", {}, env, shape, x, OneBitAdam, freeze_step=1)
    v["trainkit pipeline 1F1B (a stage per node)"] = pipeline_variant({}, env, shape, x, microbatches)
    for stage in (1, 2, 3):
        ds = deepspeed_variant(stage, shape, x)
        if ds is not None:
            v[f"DeepSpeed ZeRO-{stage}"] = ds
    v[f"2 {APART}"] = Variant(local_variant(shape, x))
    return v


def variants_2x2(env: Environment, shape: tuple[int, int, int], x: torch.Tensor, microbatches: int
                 ) -> dict[str, Variant]:
    return {
        "trainkit ddp (4 ranks)": trainkit_variant("ddp", {}, env, shape, x),
        "trainkit fsdp (4 ranks)": trainkit_variant("fsdp", {}, env, shape, x),
        "trainkit HSDP (shard in node, replicate across)": trainkit_variant(
            "parallel", {"dp_replicate": 2, "dp_shard": 2}, env, shape, x),
        "torch FSDP2 (4 ranks)": Variant(torch_fsdp2_variant(shape, x)),
        "trainkit pipeline 1F1B (a stage per node) x 2 replicas": pipeline_variant(
            {"dp_replicate": 2}, env, shape, x, microbatches),
        f"4 {APART}": Variant(local_variant(shape, x)),
    }


def cp_workload(smoke: bool) -> tuple[int, int]:
    """(sequence length, width) of the context-parallel layout's demo GPT."""
    return (256, 32) if smoke else (4096, 128)


def variants_cp(env: Environment, smoke: bool) -> tuple[dict[str, Variant], Any]:
    """Context parallelism across the link: the demo GPT (2 blocks, 4 heads) on one sequence, cp=2 with each
    attention method; and one rank's step on the whole sequence alone."""
    from trainkit.demo.gpt import DemoGPT

    seq, width = cp_workload(smoke)
    tokens = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])

    def build(strategy: Any) -> Any:
        torch.manual_seed(0)
        model = DemoGPT(vocab_size=256, block_size=seq, n_layer=2, n_head=4, n_embd=width)
        strategy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), Precision.from_name("32"))
        local = strategy.local_batch(batch)

        def step() -> None:
            with strategy.forward_context():
                loss = model.training_step(local, 0)["loss"]
            strategy.backward(loss)
            strategy.reduce_gradients(1.0 / strategy.item_ranks)
            strategy.optimizer_step()
            strategy.zero_grad()

        return step

    variants = {}
    for method in ("ring", "all_gather", "ulysses"):
        strategy = get_strategy("parallel", cp=2, cp_method=method)
        strategy.setup_environment(env)
        variants[f"trainkit cp2 {method}"] = Variant(build(strategy))
    single = get_strategy("single")
    single.setup_environment(Environment(rank=0, world_size=1))
    return variants, build(single) if env.rank == 0 else None


# -- the worker: one rank ------------------------------------------------------------------------------------------
def link_bytes(interface: str | None) -> int | None:
    """Bytes this node's interface has sent (``/proc/net/dev`` is per network namespace)."""
    if not interface:
        return None
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    return None


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    env = Environment.from_env("cpu", timeout_s=900)
    Comm.connect(env)
    rank, world = env.rank, env.world_size
    interface = os.environ.get("GLOO_SOCKET_IFNAME") if env.local_rank == 0 else None
    shape = (64, 128, 2) if args.smoke else (512, 2048, 4)
    batch = 8 if args.smoke else 32
    x = torch.randn(batch, shape[0], generator=torch.Generator().manual_seed(rank))
    if args.layout == "cp":
        variants, local = variants_cp(env, args.smoke)
    else:
        build = variants_2x2 if args.layout == "2x2" else variants_2x1
        variants = build(env, shape, x, 2 if args.smoke else 4)
        local = local_variant(shape, x) if rank == 0 else None
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        variants = {n: v for n, v in variants.items() if any(w in n for w in wanted)}
    for v in variants.values():  # warm-up (compression past its first steps)
        for _ in range(3):
            v.step()
        dist.barrier()
    times: dict[str, list[float]] = {name: [] for name in [*variants, ALONE]}
    sent: dict[str, list[int]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_index in range(args.rounds):
        rotated = order[round_index % len(order):] + order[:round_index % len(order)]
        for name, v in rotated:
            dist.barrier()
            before = link_bytes(interface)
            start = time.perf_counter()
            for _ in range(args.steps):
                v.step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
            after = link_bytes(interface)
            if before is not None and after is not None:
                sent[name].append((after - before) // args.steps)
        dist.barrier()
        if local is not None:
            start = time.perf_counter()
            for _ in range(args.steps):
                local()
            times[ALONE].append((time.perf_counter() - start) / args.steps)
        dist.barrier()
    mine = {"times": {n: statistics.median(t) for n, t in times.items() if t},
            "sent": {n: statistics.median(s) for n, s in sent.items() if s},
            "rounds": {n: t for n, t in times.items() if t}}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        result = {"layout": args.layout, "world": world, "rate_gbit": args.rate_gbit, "rounds": args.rounds,
                  "steps": args.steps, "smoke": args.smoke, "ranks": gathered}
        text = json.dumps(result)
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(report(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalisation, where c10d destructors have aborted a rank now and then


# -- the report ----------------------------------------------------------------------------------------------------
def report(result: dict) -> str:
    ranks, rate = result["ranks"], result["rate_gbit"]
    times = ranks[0]["times"]
    alone = times[ALONE]
    link = {n: max(r["sent"].get(n, 0) for r in ranks) for n in ranks[0]["sent"]}
    model = "MLP 2 x [64 -> 128 -> 64], batch 8" if result["smoke"] else "MLP 4 x [512 -> 2048 -> 512], batch 32"
    if result["layout"] == "cp":
        seq, width = cp_workload(result["smoke"])
        model = f"demo GPT 2 blocks x width {width}, 4 heads, one sequence of {seq} tokens (cp=2: half each)"
    where = f"link {rate:g} Gb/s" if rate else "loopback (no shaped link)"
    lines = [f"{result['layout']} ({result['world']} ranks), {where}, gloo, 1 thread per rank, {model} per rank, "
             f"AdamW; median of {result['rounds']} rounds x {result['steps']} steps",
             f"{'variant':<56}{'step':>10}{'x ref':>8}{'link MB':>9}{'bound':>10}{'+ alone':>10}{'effic.':>8}"]
    refs = {"trainkit ddp": "torch DDP", "trainkit zero1": "trainkit ddp", "trainkit zero2": "trainkit ddp",
            "trainkit zero_offload": "trainkit ddp", "trainkit fsdp": targets.LINK_FSDP2,
            "trainkit zero3": targets.LINK_FSDP2, "trainkit ddp powersgd r1": "trainkit ddp",
            "trainkit ddp powersgd r4": "trainkit ddp", "trainkit ddp + 1-bit Adam": "trainkit ddp",
            "trainkit fsdp (4 ranks)": "torch FSDP2 (4 ranks)",
            "trainkit HSDP (shard in node, replicate across)": "trainkit fsdp (4 ranks)",
            "trainkit cp2 all_gather": "trainkit cp2 ring", "trainkit cp2 ulysses": "trainkit cp2 ring"}
    rounds = ranks[0].get("rounds", {})
    ratios: dict[tuple[str, str], float] = {}
    for name, t in times.items():
        if name == ALONE:
            continue
        ref = refs.get(name)
        if ref in times:
            ratios[(name, ref)] = _paired(rounds.get(name), rounds.get(ref), t, times[ref])
        ratio = f"{ratios[(name, ref)]:.3f}" if ref in times else ""
        sent = link.get(name)
        link_s = sent * 8 / (rate * 1e9) if sent is not None and rate else None
        bound = "-" if link_s is None else f"{link_s * 1e3:.1f}"
        serial = "-" if link_s is None else f"{(link_s + alone) * 1e3:.1f}"
        lines.append(f"{name:<56}{t * 1e3:>7.1f} ms{ratio:>8}{_mb(sent):>9}{bound:>7} ms{serial:>7} ms"
                     f"{alone / t:>8.3f}")
    alone_label = "1 rank, the whole sequence" if result["layout"] == "cp" else ALONE
    lines.append(f"{alone_label:<56}{alone * 1e3:>7.1f} ms")
    lines.append("x ref: against torch DDP (ddp), trainkit ddp (zero1/2, offload, compression), torch FSDP2 (fsdp, "
                 "zero3), fsdp over 4 (HSDP), the ring (cp2), the median over rounds of the two's ratio in a round. "
                 "link MB: sent per step by the busier node (interface counters). bound: link MB at the rate; "
                 "+ alone: that plus one rank's step alone (no overlap at all). effic.: 1 rank alone / the variant.")
    if result["rate_gbit"]:  # the targets are for the shaped link; loopback (--smoke) has none
        lines += targets.verdict(f"link {result['layout']}", ratios)
    elif result["smoke"]:
        lines.append(targets.SMOKE)
    return "\n".join(lines)


def _paired(mine: list[float] | None, ref: list[float] | None, median: float, ref_median: float) -> float:
    """The median over rounds of the ratio within a round: the variants alternate inside a round, so a slow spell of
    a shared machine slows both sides of a ratio (the ratio of the two medians where rounds are missing)."""
    if mine and ref and len(mine) == len(ref):
        return statistics.median(a / b for a, b in zip(mine, ref, strict=True))
    return median / ref_median


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


# -- the driver: the link and the ranks ----------------------------------------------------------------------------
def _rate_gbit(rate: str) -> float:
    units = {"gbit": 1.0, "mbit": 1e-3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise SystemExit(f"--rates takes tc rates such as 1gbit or 500mbit; got {rate!r}")


def launch(layout: str, rate: str | None, args: argparse.Namespace, port: int) -> dict:
    """Start the ranks of ``layout`` (in the two namespaces when ``rate``, else on loopback); their result."""
    per_node = 2 if layout == "2x2" else 1
    world = 2 * per_node
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        procs = []
        for rank in range(world):
            node = "a" if rank < per_node else "b"
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
                   "LOCAL_WORLD_SIZE": str(per_node), "MASTER_PORT": str(port),
                   "MASTER_ADDR": NODE_ADDR["a"] if rate else "127.0.0.1", "OMP_NUM_THREADS": "1"}
            if rate:
                env["GLOO_SOCKET_IFNAME"] = f"tkv{node}"
            cmd = [sys.executable, __file__, "--worker", "--layout", layout, "--rounds", str(args.rounds),
                   "--steps", str(args.steps), "--rate-gbit", str(_rate_gbit(rate) if rate else 0)]
            cmd += ["--out", str(out)] if rank == 0 else []
            cmd += ["--smoke"] if args.smoke else []
            cmd += ["--only", args.only] if args.only else []
            if rate:
                cmd = ["bash", str(args.netsim), "run", node, *cmd]
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as err:
                for q in procs:
                    q.kill()
                raise SystemExit(f"{layout} at {rate or 'loopback'}: ranks still running after "
                                 f"{args.timeout} s") from err
        if any(p.returncode for p in procs):
            raise SystemExit(f"{layout} at {rate or 'loopback'}: a rank failed (exit codes "
                             f"{[p.returncode for p in procs]})")
        return json.loads(out.read_text())


def can_shape(netsim: Path) -> str | None:
    """Why a link cannot be built here, or None."""
    if sys.platform != "linux":
        return "not Linux"
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need it)"
    if not netsim.is_file():
        return f"no netsim script at {netsim} (--netsim)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,10gbit", help="tc rates of the link, comma-separated")
    parser.add_argument("--layouts", default="2x1,2x2", help="nodes x ranks per node: 2x1, 2x2; cp: the demo "
                        "GPT at cp=2 (ring, all-gather, Ulysses), a rank per node")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--smoke", action="store_true", help="tiny model over loopback, no link (CI)")
    parser.add_argument("--netsim", type=Path, default=NETSIM, help="the script that builds the link")
    parser.add_argument("--timeout", type=float, default=3000.0, help="seconds per layout and rate")
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument("--only", help="run only the variants whose names contain one of these comma-separated "
                        "words (e.g. 'ddp,1-bit'); the references a ratio needs must be named too")
    # the worker (one rank; under torchrun on real nodes)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="2x1", help=argparse.SUPPRESS)
    parser.add_argument("--rate-gbit", type=float, default=0.0, help="the link's rate, for the bound (--worker)")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    layouts = args.layouts.split(",")
    if args.smoke:
        args.rounds, args.steps = 2, 1
        rates: list[str | None] = [None]
    else:
        why = can_shape(args.netsim)
        if why:
            raise SystemExit(f"cannot build a shaped link here: {why}. Run as root on Linux with iproute2, or run "
                             "the worker on real nodes (torchrun ... benchmarks/link.py --worker), or --smoke for "
                             "loopback.")
        rates = args.rates.split(",")
    results = []
    try:
        for rate in rates:
            if rate:
                subprocess.run(["bash", str(args.netsim), "up", rate], check=True)
            for layout in layouts:
                result = launch(layout, rate, args, port=29611 + len(results))
                results.append(result)
                print(report(result), flush=True)
                print(flush=True)
    finally:
        if rates != [None]:
            subprocess.run(["bash", str(args.netsim), "down"], check=False)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
