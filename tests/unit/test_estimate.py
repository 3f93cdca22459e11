"""``trainkit estimate`` against what strategies hold when they run: model-state bytes equal the storages a real
step leaves alive, activation bytes match a real step's, and a 1B model at 64 ranks is planned from the
meta device without allocating it."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.e2e.docs_blocks import items, output_pattern
from tests.helpers import Regression, loader, regression_data
from tests.measure import Alive
from trainkit.demo.gpt import DemoGPT
from trainkit.estimate import AUTO_ORDER, choose, estimate, human, parse_bytes
from trainkit.optim import OneBitAdam
from trainkit_strategies import ActivationMeter, Environment, Precision, get_strategy

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ["ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline"]


def _gpt(device: str | None = None) -> DemoGPT:
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return DemoGPT(n_layer=2)


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 16, (n, 64), generator=gen), torch.randint(0, 16, (n, 64), generator=gen)


def _measured(name: str, world: int, rank: int, precision: str, alive: Alive) -> tuple[int, int, int]:
    """The bytes of ``name`` at the peak of a real step (after the update, before ``zero_grad``) as ``rank`` of
    ``world`` (torch's fake process group stands in for the other ranks and moves no data): every storage that came
    to life since ``alive`` was entered (before any model was built) and is still held, found by a sweep of the
    garbage collector's objects; and the device and host bytes ``memory_report()`` gives."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return _step_and_report(name, world, rank, precision, alive)
    finally:
        dist.destroy_process_group()


def _step_and_report(name: str, world: int, rank: int, precision: str, alive: Alive) -> tuple[int, int, int]:
    module = _gpt()
    options = {"stages": world} if name == "pipeline" else {}
    strategy = get_strategy(name, **options)
    strategy.setup_environment(Environment(rank=rank, world_size=world))
    strategy.setup(module, module.configure_optimizers()["optimizer"], Precision.from_name(precision))
    if name == "pipeline":  # its schedule needs real peers; give its stage's parameters gradients directly
        for p in strategy.pipeline._stage.parameters():
            p.grad = torch.zeros_like(p)
    else:
        with strategy.forward_context():
            loss = module.training_step(_batch(), 0)["loss"]
        strategy.backward(loss)
        del loss  # the step's activations are gone with it: what is left is model state
    strategy.reduce_gradients(1.0)
    strategy.optimizer_step()
    report = strategy.memory_report()  # at the step's peak: gradients still held (zero_grad frees some)
    held = alive.bytes()
    strategy.teardown()  # as the Trainer does after fit: nothing of this strategy outlives it
    return held, report.device_total, report.host_total


@pytest.mark.parametrize("fake_world", [2, 4], ids=["W2", "W4"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "32"])
def test_estimated_model_state_equals_what_every_strategy_holds(fake_world, precision):
    """The estimate's model-state bytes against the storages a real step leaves alive (a forgotten tensor, or one
    counted that is not there, changes the sum); how they divide between device and host (both are this machine's
    memory here) against ``memory_report()``, which places each tensor."""
    planned = estimate(_gpt("meta"), _batch(), world_size=fake_world, precision=precision)
    with Alive() as swept:  # each strategy's storages are freed with it, before the next is built
        for name in STRATEGIES:
            row = planned.row(name)
            ranks = range(fake_world) if name == "pipeline" else [1]  # the estimate reports the heaviest rank
            alive, device, host = max(_measured(name, fake_world, rank, precision, swept) for rank in ranks)
            assert row.device + row.host == alive, f"{name}: estimated {row.device + row.host} B, alive {alive} B"
            assert (row.device, row.host) == (device, host), f"{name}: estimated {(row.device, row.host)}"
            print(f"{name} W={fake_world} {precision}: device {row.device} B, host {row.host} B, alive {alive} B")


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_estimated_activations_match_a_real_step(precision):
    """The fake-tensor trace of one micro-batch against the bytes a real CPU step saves for backward."""
    planned = estimate(_gpt("meta"), _batch(32), precision=precision, strategies=["ddp"])
    module = _gpt()
    with ActivationMeter(exclude=module.parameters()) as meter, \
            Precision.from_name(precision).forward_context(torch.device("cpu")):
        module.training_step(_batch(32), 0)
    row = planned.row("ddp")
    assert abs(row.activations - meter.bytes) <= 0.1 * meter.bytes, (row.activations, meter.bytes)
    assert row.activations_checkpointed < 0.5 * row.activations  # the blocks recompute instead of saving


BIG = '''
import json, resource, sys, torch
from trainkit.demo.gpt import DemoGPT
from trainkit.estimate import estimate
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.device("meta"):
    module = DemoGPT(vocab_size=50304, block_size=1024, n_layer=20, n_head=16, n_embd=2048)  # ~1.06B
batch = (torch.zeros(1, 1024, dtype=torch.long), torch.zeros(1, 1024, dtype=torch.long))
planned = estimate(module, batch, world_size=64, precision="bf16-mixed", strategies=["zero2", "fsdp"], layouts=[])
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print(json.dumps({"params": planned.parameters, "peak": peak,
                  "rows": {r.strategy: [r.device, r.host] for r in planned.rows}}))
'''


@pytest.mark.slow
def test_a_1b_model_at_64_ranks_is_planned_without_allocating_it():
    proc = subprocess.run([sys.executable, "-c", BIG], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    psi = out["params"]
    assert 1.0e9 < psi < 1.2e9
    assert out["peak"] < 4 * psi / 10  # a tenth of the fp32 model: nothing of the model's size was allocated
    fsdp = out["rows"]["fsdp"][0]
    # 16Ψ/N, the two reduce-scatter buffers (each the largest flat: the 50304 x 2048 embedding) and a little more
    assert 16 * psi / 64 <= fsdp <= 1.05 * 16 * psi / 64 + 2 * 50304 * 2048 * 2
    print(f"{psi / 1e9:.2f}B params at 64 ranks: fsdp {fsdp / 2**20:.0f} MiB/rank, planning peak RSS "
          f"+{out['peak'] / 2**20:.0f} MiB")


def test_sizes_parse():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24GiB") == 24 * 2**30 and parse_bytes(512) == 512
    with pytest.raises(ValueError, match="80 gigs"):
        parse_bytes("80 gigs")


SEVEN_B = next(item for item in items(ROOT / "docs" / "planning.md") if "--model.n_embd 4096" in item.text)


@pytest.mark.slow
def test_estimate_of_a_7_5b_model_at_64_ranks_agrees_with_the_zero_paper(capsys):
    """Rajbhandari et al. (2020), §5: per rank, DP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N; the
    stages that reduce-scatter during backward add two gradient buckets (backward fills one while the other is on the
    wire), each the largest flat: zero3's the 50304 x 4096 embedding (0.41 GB in bf16), fsdp's its root unit's
    decayed parameters (the token and position embeddings, 0.43 GB)."""
    from trainkit.cli import main

    main(args=shlex.split(SEVEN_B.text)[1:])  # planning.md's command, whose table the page shows
    out = capsys.readouterr().out
    print(out)
    missing = [p.pattern for p in output_pattern(SEVEN_B.expect) if not p.search(out)]
    assert not missing, f"planning.md's table (its words; figures are checked below) differs: {missing}"
    psi = float(out.split("B parameters")[0]) * 1e9
    n, bucket, root = 64, 50304 * 4096 * 2, (50304 + 2048) * 4096 * 2
    rows = {line.split()[0]: float(line.split()[1]) * 1e9 for line in out.splitlines()[2:] if line.split()[2] == "GB"}
    assert 7.4e9 < psi < 7.6e9
    expected = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n + 2 * bucket,
                "zero3": 16 * psi / n + 2 * bucket, "fsdp": 16 * psi / n + 2 * root}
    for name, want in expected.items():
        assert abs(rows[name] - want) <= 0.01 * want, (name, rows[name], want)
    # the layout rows: tp=8 within a node x dp_shard=8 holds about fsdp's model state (1/64 of it, plus one bucket of
    # a tp-split unit in flight) and, under sequence parallelism, 1/8 of its activations
    table = {line[:14].strip(): line[14:].split() for line in out.splitlines()[2:]}
    assert {"tp2 dp32", "tp4 dp16", "tp8 dp8", "pp2 tp8 dp4", "pp4 tp8 dp2"} <= table.keys(), table.keys()
    gb = {"GB": 1e9, "MB": 1e6}

    def size(row: str, column: int) -> float:
        return float(table[row][2 * column]) * gb[table[row][2 * column + 1]]

    assert size("tp8 dp8", 0) <= rows["fsdp"]
    assert abs(size("tp8 dp8", 3) - size("fsdp", 3) / 8) <= 0.1 * size("fsdp", 3) / 8, (table["tp8 dp8"], table["fsdp"])
    assert "comm tp" in " ".join(table["tp8 dp8"]) and "dp_shard" in " ".join(table["tp8 dp8"])


class _OneBitRegression(Regression):
    def configure_optimizers(self) -> OneBitAdam:
        return OneBitAdam(self.parameters(), lr=1e-2)


def test_a_self_reducing_optimizer_leaves_out_the_strategies_that_cannot_run_it():
    """strategy='auto' then chooses among ddp, zero1 and zero2 only; estimate says why the others are out."""
    batch = next(iter(loader(regression_data(8), 4)))
    plan = estimate(_OneBitRegression(), batch, world_size=2, strategies=AUTO_ORDER, device_memory="1GB")
    assert {row.strategy: row.applies for row in plan.rows} == {
        "ddp": True, "zero1": True, "zero2": True, "fsdp": False, "zero_offload": False}
    assert plan.row("fsdp").note == "n/a: OneBitAdam does not run under fsdp"
    assert plan.row("ddp").device > 0
    assert choose(plan, checkpointing=False).strategy == "ddp"


FIVE_B = ["estimate", "--model.vocab_size", "50304", "--model.block_size", "1024", "--model.n_layer", "26",
          "--model.n_head", "32", "--model.n_embd", "4096", "--data", "trainkit.demo.markov.MarkovData",
          "--data.seq_len", "1024", "--data.batch_size", "1", "--data.train_sequences", "4",
          "--trainer.precision", "bf16-mixed", "--device_type", "cuda", "--device_memory", "80GB"]


@pytest.mark.slow
def test_the_5_4b_offload_plan_fits_a_gpu_and_a_128_gb_host(capsys):
    """The GPT of benchmarks/offload.py --gpu (d=4096, 26 layers, 5.4B parameters) under zero_offload on one GPU,
    batch 1 x 1024: the host holds 14 bytes a parameter (fp32 master 4, Adam's moments 8, and the only page-locked
    buffer, the bf16 gradient partition 2, over which the step writes the bf16 parameters going back) plus two
    staging pieces: <= 80 GB, so a 7B model fits a 128 GB host; the
    device holds the bf16 working parameters (2 bytes a parameter), buckets in flight and activations, with no
    autocast copies of the weights (they are bf16 already): <= 20 GB (DeepSpeed measured 20.8 GB there), and its
    setup never holds the fp32 model."""
    from trainkit.cli import main

    main(args=FIVE_B)
    out = capsys.readouterr().out
    print(out)
    psi = float(out.split("B parameters")[0]) * 1e9
    line = next(line.split() for line in out.splitlines() if line.startswith("zero_offload"))
    gb = [float(line[i]) * {"GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}[line[i + 1]] for i in range(1, 15, 2)]
    device, host, pinned, activations, _, setup, _ = gb
    largest_piece = 50304 * 4096  # the embedding's bucket
    assert 5.4e9 < psi < 5.5e9
    assert abs(host - (14 * psi + 2 * 2 * largest_piece)) <= 0.01 * host, (host, 14 * psi)
    assert abs(pinned - (2 * psi + 2 * 2 * largest_piece)) <= 0.01 * pinned
    assert host <= 80e9
    assert device + activations <= 20e9 and setup <= 20e9, (device, activations, setup)
    assert setup < 2 * psi + 4 * 4 * largest_piece  # bf16 working copy, one fp32 bucket, device scratch


def _live_bytes() -> dict[int, int]:
    """Every host storage alive in this process, found through the garbage collector (not through any strategy's
    own account of what it holds): data pointer -> bytes."""
    import gc

    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr():
                found[storage.data_ptr()] = storage.nbytes()
    return found


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_offload_plan_is_what_a_run_holds(accumulate):
    """zero_offload under bf16-mixed on the CPU: the bytes ``trainkit estimate`` plans (device and host state; on a
    CPU both are the same memory) are the bytes of every tensor a real run holds after three steps, stepping during
    backward and with accumulation, counted as the storages the garbage collector finds that the run created."""
    from trainkit import TrainModule

    class Stack(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)], torch.nn.LayerNorm(256))

        def training_step(self, batch, batch_idx):
            return self.net(batch).float().pow(2).mean()

        def configure_optimizers(self):  # three groups: three buckets, stepped one by one
            decay = [p for p in self.parameters() if p.dim() > 1]
            rest = [p for p in self.parameters() if p.dim() <= 1]
            return torch.optim.AdamW([{"params": decay[:3]}, {"params": decay[3:], "lr": 2e-3},
                                      {"params": rest, "weight_decay": 0.0}], lr=1e-3)

    x = torch.randn(4, 256)
    with torch.device("meta"):
        row = estimate(Stack(), x, 1, "bf16-mixed", strategies=["zero_offload"], layouts=[]).rows[0]
    before = _live_bytes()
    torch.manual_seed(0)
    module = Stack()
    strategy = get_strategy("zero_offload", overlap_step=True)
    strategy.setup_environment(Environment())
    strategy.setup(module, module.configure_optimizers(), Precision.from_name("bf16-mixed"))
    assert len(strategy.buckets) >= 3
    for _ in range(3):
        for micro in range(accumulate):
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else strategy.no_sync():
                with strategy.forward_context():
                    loss = module.training_step(x, 0)
                if last:
                    assert strategy.step_in_backward(1.0 / accumulate)
                strategy.backward(loss)
        strategy.reduce_gradients(1.0 / accumulate)
        strategy.optimizer_step()
        strategy.zero_grad()
    del loss
    held = sum(n for ptr, n in _live_bytes().items() if ptr not in before)
    assert held == row.device + row.host, (held, row.device, row.host)
    strategy.teardown()


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_estimated_bytes_per_step_equal_a_real_step(precision):
    """Each strategy's comm/step is what its own code issues in a step (padding, buffer broadcasts, a persistent
    unit re-gathered once, the pipeline's activations and gradients, tied weights), measured against ``Comm.stats``
    of a real second step (the first sends the pipeline's shape headers) of 2 ranks that move real values
    (threads of this process, ``tests/simworld.py``), for the rank the estimate plans."""
    from tests.simworld import CPU, SimWorld

    planned = estimate(_gpt("meta"), _batch(4), world_size=2, precision=precision)
    batches = [_batch(4), _batch(4)]
    for name in STRATEGIES:
        row = planned.row(name)
        world = SimWorld(2, device=CPU)
        models = [_gpt() for _ in range(2)]

        def rank(r: int, name: str = name, world: SimWorld = world, models: list = models) -> dict[str, int]:
            strategy = get_strategy(name, **({"stages": 2} if name == "pipeline" else {}))
            strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
            module = models[r]
            strategy.setup(module, module.configure_optimizers()["optimizer"], Precision.from_name(precision))
            for batch in batches:
                for comm in strategy.comms():
                    comm.stats.reset()
                if name == "pipeline":
                    strategy.pipeline.run_schedule(module, batch, 1.0)
                else:
                    with strategy.forward_context():
                        strategy.backward(module.training_step(batch, 0)["loss"])
                strategy.reduce_gradients(1.0)
                strategy.optimizer_step()
                strategy.zero_grad()
            moved: dict[str, int] = {}
            for comm in strategy.comms():
                for kind, n in comm.stats.bytes.items():
                    moved[kind] = moved.get(kind, 0) + n
            return moved

        real = world.run(rank)[row.rank]
        assert row.comm_by_kind == real, f"{name}: estimated {row.comm_by_kind}, a real step moved {real}"
        assert row.comm == sum(real.values())


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed", "bf16-true"])
def test_estimated_activations_follow_precision_and_strategy(precision):
    """The activations column traces each precision in its own dtypes and each strategy with the parameters it
    computes with: under bf16-mixed, ddp's fp32 weights are copied to bf16 by autocast (saved for backward: about 2
    bytes a parameter more) where zero2 and fsdp compute with bf16 working parameters; bf16-true saves half of fp32.
    Each row is held within 10% to the bytes a real step saves on rank 1 of 2 (threads of this process)."""
    from tests.simworld import CPU, SimWorld

    batch = _batch(8)
    planned = estimate(_gpt("meta"), batch, world_size=2, precision=precision, strategies=["ddp", "zero2", "fsdp"])
    policy = Precision.from_name(precision)
    measured = {}
    for name in ("ddp", "zero2", "fsdp"):
        world = SimWorld(2, device=CPU)
        models = [_gpt() for _ in range(2)]

        def rank(r: int, name: str = name, world: SimWorld = world, models: list = models) -> int:
            strategy = get_strategy(name)
            strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
            module = models[r]
            strategy.setup(module, module.configure_optimizers()["optimizer"], policy)
            with ActivationMeter(exclude=module.parameters()) as meter, strategy.forward_context():
                module.training_step(policy.convert_input(batch), 0)
            return meter.bytes

        measured[name] = world.run(rank)[1]
        row = planned.row(name)
        assert abs(row.activations - measured[name]) <= 0.1 * measured[name], (name, row.activations, measured[name])
    if precision == "bf16-mixed":  # the autocast copies of ddp's fp32 weights, which the sharded strategies skip
        assert planned.row("ddp").activations > 1.2 * planned.row("zero2").activations
    print(precision, {name: (planned.row(name).activations, measured[name]) for name in measured})


def test_a_model_without_data_gets_its_model_state_rows(capsys):
    """No data to take a batch from: the model-state columns still come out (equal to a batch-driven plan's), the
    activations and the step's bytes read "?", and one line says how to get them."""
    from trainkit.cli import main

    main(args=["estimate", "--model", "tests.helpers.Regression", "--trainer.devices", "2"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split() and "?" in line}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline"}
    assert "activations and comm/step are unknown without a batch to trace: pass --data" in out
    with_data = estimate(Regression(), next(iter(loader(regression_data(8), 4))), world_size=2)
    for name in ("ddp", "zero2", "zero_offload", "fsdp"):
        assert rows[name][1:3] == human(with_data.row(name).device).split(), name


LAYOUTS = [{"tp": 2, "pp": 1}, {"tp": 4, "pp": 1}, {"tp": 2, "pp": 2}]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_layout_rows_equal_a_real_step(precision):
    """Each layout row of ``strategy="parallel"`` (tp2 x dp_shard2, tp4, pp2 x tp2 at 4 ranks) against a real run of
    that layout on 4 ranks that move real values (threads of this process): the model state the planned rank holds
    at the second step's peak (``memory_report()``, and its tensors counted directly), the bytes its collectives
    moved along each axis (``Comm.stats``), and the bytes its forward saved for backward (within 10%, tp4)."""
    from tests.simworld import CPU, SimWorld

    batch = _batch(4)
    planned = estimate(_gpt("meta"), batch, world_size=4, precision=precision, strategies=[])
    assert [r.options for r in planned.rows] == LAYOUTS  # the layouts the demo GPT allows at 4 ranks (4 blocks)
    policy = Precision.from_name(precision)
    for row in planned.rows:
        world = SimWorld(4, device=CPU)
        models = [_gpt() for _ in range(4)]

        def rank(r: int, world: SimWorld = world, models: list = models, options: dict = row.options) -> dict:
            strategy = get_strategy("parallel", microbatches=4, **options)
            strategy.setup_environment(Environment(rank=r, world_size=4), comm=world.comm(r))
            module = models[r]
            strategy.setup(module, module.configure_optimizers()["optimizer"], policy)
            out: dict = {}
            for step in range(2):
                for comm in strategy.comms():
                    comm.stats.reset()
                if options["pp"] > 1:
                    strategy.pipeline.run_schedule(module, batch, 1.0)
                else:
                    with ActivationMeter(exclude=module.parameters()) as meter, strategy.forward_context():
                        loss = module.training_step(policy.convert_input(batch), 0)["loss"]
                    out["activations"] = meter.bytes
                    strategy.backward(loss)
                strategy.reduce_gradients(1.0)
                strategy.optimizer_step()
                if step == 1:
                    report = strategy.memory_report()
                    optimizer = strategy.optimizer
                    held = [*strategy.trainable(), *(p.grad for p in strategy.trainable() if p.grad is not None),
                            *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
                    out["report"] = (report.device_total, report.host_total)
                    out["held"] = sum(t.numel() * t.element_size() for t in {id(t): t for t in held}.values())
                    out["axes"], seen = {}, set()
                    for axis, comms in strategy.comms_by_axis().items():  # a communicator counted once, on its axis
                        for comm in comms:
                            if id(comm) not in seen:
                                seen.add(id(comm))
                                out["axes"][axis] = out["axes"].get(axis, 0) + sum(comm.stats.bytes.values())
                    out["all"] = sum(sum(c.stats.bytes.values()) for c in {id(c): c for c in strategy.comms()}.values())
                strategy.zero_grad()
            return out

        real = world.run(rank)[row.rank]
        assert (row.device, row.host) == real["report"], (row.strategy, row.device, real["report"])
        if options_shard(row.options) == 1:  # nothing sharded: the rank's own tensors are its whole state
            assert row.device >= real["held"], (row.strategy, row.device, real["held"])
        moved = {axis: n for axis, n in real["axes"].items() if n}
        planned_axes = {axis: n for axis, n in row.comm_by_axis.items() if n}
        assert sum(real["axes"].values()) == real["all"]  # the axes account for every byte
        if precision == "32":
            assert planned_axes == moved, (row.strategy, planned_axes, moved)
            assert row.comm == real["all"]
        else:  # the meta device runs no autocast: tensor-parallel activations are counted in fp32, at most 2x
            assert planned_axes.keys() == moved.keys(), (row.strategy, planned_axes, moved)
            for axis, n in moved.items():
                assert (n <= planned_axes[axis] <= 2 * n) if axis in ("tp", "pp") else planned_axes[axis] == n, \
                    (row.strategy, axis, planned_axes[axis], n)
        if "activations" in real and options_shard(row.options) == 1:  # (under FSDP units the meter would also
            # count the gathered weights autograd keeps a view of, which are freed after forward and gathered again)
            assert abs(row.activations - real["activations"]) <= 0.1 * real["activations"], \
                (row.strategy, row.activations, real["activations"])
        print(precision, row.strategy, row.device, row.comm_by_axis, row.activations, real.get("activations"))


def options_shard(options: dict) -> int:
    return 4 // (options["tp"] * options["pp"])


def _llama(device: str | None = None):
    from trainkit.hf import CausalLM

    torch.manual_seed(0)
    module = CausalLM(config={"model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    with torch.device(device or "cpu"):
        module.configure_model()
    return module


def test_a_hugging_face_model_is_planned_as_it_runs():
    """``trainkit estimate`` on a transformers Llama (its mask code reads values a meta tensor has none of): the rows
    of the data-parallel strategies and of the tp=2 and cp=2 layouts at 2 ranks against a real step of each on 2
    ranks that move real values (threads of this process): the planned rank's model state (``memory_report()``) and
    the bytes of every collective kind (``Comm.stats``) equal. A layout the model's heads cannot divide into is
    a row saying so."""
    pytest.importorskip("transformers")
    from tests.simworld import CPU, SimWorld

    batch = _batch(4)
    layouts = [{"tp": 2}, {"cp": 2}]
    planned = estimate(_llama("meta"), batch, world_size=2, strategies=["ddp", "zero2", "fsdp"], layouts=layouts)
    assert [r.strategy for r in planned.rows] == ["ddp", "zero2", "fsdp", "tp2", "cp2"]
    n = sum(p.numel() for p in _llama().parameters())
    # fp32 weights, gradients and AdamW's two moments, whole (and its step counts, the rotary buffers: < 4 KB)
    assert 16 * n <= planned.row("ddp").device < 16 * n + 4096
    for row in planned.rows:
        world = SimWorld(2, device=CPU)
        models = [_llama() for _ in range(2)]

        def rank(r: int, world: SimWorld = world, models: list = models, row=row) -> tuple:
            strategy = get_strategy(row.name, **row.options)
            strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
            module = models[r]
            strategy.setup(module, module.configure_optimizers()["optimizer"], Precision.from_name("32"))
            moved: dict[str, int] = {}
            for comm in {id(c): c for c in strategy.comms()}.values():
                comm.stats.reset()
            with strategy.forward_context():  # on the rank's tokens (its chunks of every sequence under cp)
                strategy.backward(module.training_step(strategy.local_batch(batch), 0)["loss"])
            strategy.reduce_gradients(1.0)
            strategy.optimizer_step()
            for comm in {id(c): c for c in strategy.comms()}.values():
                for kind, b in comm.stats.bytes.items():
                    moved[kind] = moved.get(kind, 0) + b
            return strategy.memory_report().device_total, {k: b for k, b in moved.items() if b}

        device, moved = world.run(rank)[row.rank]
        assert row.device == device, (row.strategy, row.device, device)
        assert {k: b for k, b in row.comm_by_kind.items() if b} == moved, (row.strategy, row.comm_by_kind, moved)
        print(row.strategy, row.device, moved)
    too_many = estimate(_llama("meta"), batch, world_size=4, strategies=[], layouts=[{"tp": 4}])
    assert "2 key/value heads" in too_many.row("tp4").note and not too_many.row("tp4").applies


def test_an_expert_parallel_layout_is_planned_with_its_all_to_all_bytes():
    """examples/moe.py's Mixtral at 2 ranks: an ``ep2`` row (offered for a model with MoE layers) whose model state is
    what a real step holds, whose all-to-all bytes are the formula's at balanced routing (tokens x hidden x top-k x
    4 B x 2 directions x forward and backward x layers), and which names the expert weights a rank holds."""
    from tests.simworld import CPU, SimWorld
    from tests.unit.test_expert_parallel import DIM, LAYERS, TOP_K, _model

    with torch.device("meta"):
        module = _model()
    x = torch.randint(0, 16, (4, 8))
    planned = estimate(module, (x, x), world_size=2, strategies=["ddp"])
    row = planned.row("ep2")
    assert row.options == {"ep": 2} and row.applies
    assert row.comm_by_kind["all_to_all"] == 4 * 8 * DIM * TOP_K * 4 * 2 * 2 * LAYERS
    experts = sum(m.w1.numel() * 3 for m in _model().modules() if hasattr(m, "w1") and m.w1.dim() == 3) // 2 * 4
    assert f"expert weights {experts / 1e6:.2f} MB per rank" in row.note
    world = SimWorld(2, device=CPU)

    def rank(r: int) -> int:
        model = _model()
        strategy = get_strategy("parallel", ep=2)
        strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
        strategy.setup(model, model.configure_optimizers()["optimizer"], Precision.from_name("32"))
        with strategy.forward_context():
            strategy.backward(model.training_step((x, x), 0)["loss"])
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
        return strategy.memory_report().device_total

    assert world.run(rank)[row.rank] == row.device


def test_the_runs_own_layout_is_refused_when_its_setup_cannot_fit_naming_those_that_do():
    """A layout whose training fits but whose setup overflows the host (one whole tensor rebuilt at a time) or the
    device is refused with one error naming the rows that fit; one that fits passes."""
    from trainkit.errors import ConfigurationError
    from trainkit.estimate import Estimate, StrategyEstimate

    rows = [StrategyEstimate("pp4 tp8", device=10, setup=12, setup_host=70, name="parallel", options={"tp": 8}),
            StrategyEstimate("fsdp", device=20, setup=30, setup_host=40),
            StrategyEstimate("ddp", device=20, setup=95, setup_host=40)]
    plan = Estimate(1, 32, "32", rows, device_memory=100, host_memory=50, named="pp4 tp8")
    with pytest.raises(ConfigurationError) as err:
        plan.refuse_unfit()
    message = str(err.value)
    assert "setup peaks at 12 B on the device and 70 B in host memory" in message, message
    assert "These fit: fsdp." in message, message  # not ddp: its setup overflows the device's 90%
    Estimate(1, 32, "32", rows, device_memory=100, host_memory=50, named="fsdp").refuse_unfit()


def test_a_hugging_face_moe_is_offered_expert_parallel_rows():
    """A Hugging Face Mixtral (its experts packed as transformers holds them) gets ep rows as trainkit's MoE does, the
    row naming the expert weights a rank holds: half of them at ep2; its tp rows name the plan's style trainkit does
    not run (the estimate stopped there)."""
    pytest.importorskip("transformers")
    from trainkit.hf import CausalLM

    config = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
              "num_experts_per_tok": 2}
    module = CausalLM(config=config)
    with torch.device("meta"):
        module.configure_model()
    planned = estimate(module, None, world_size=2, strategies=["ddp"])
    row = planned.row("ep2")
    assert row.options == {"ep": 2} and row.applies, row
    experts = sum(p.numel() * 4 for n, p in module.named_parameters() if ".experts." in n) // 2
    assert f"expert weights {experts / 1e6:.2f} MB per rank" in row.note, row.note
    tp = planned.row("tp2")  # its tensor-parallel plan has a style trainkit does not run: the row says so
    assert not tp.applies and "packed_colwise" in tp.note, tp.note
