"""NCCL's rules, enforced on a CPU for every strategy and pipeline schedule (``tests/simworld.py``).

Each rank runs in a thread with the ``meta`` device standing in for its GPU and host memory on the CPU; the
simulated process groups reject a collective handed a tensor off the rank's device, collectives issued in
different orders, the two ends of a communicator issuing their point-to-point operations in different orders,
and a collective crossing point-to-point traffic on another communicator; compute that mixes device and host
tensors fails as on a GPU. Every strategy sets up and trains a few optimizer steps through ``OptimizerStep``
(accumulation, clipping by norm and by value, the fp16 overflow check, ``num_items`` as a Python number and as a
device tensor), updates a torchmetrics metric on device predictions, and evaluates; the demo GPT brings tied
embeddings. A strategy or schedule added later belongs in ``STRATEGIES`` / ``SCHEDULE_GRID``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn
from torchmetrics import MeanSquaredError

from tests.simworld import META, RuleViolation, SimWorld, on_device
from trainkit.demo.gpt import DemoGPT
from trainkit.dispatch import HookDispatch
from trainkit.step import OptimizerStep, StepConfig
from trainkit_strategies import Environment, Precision, RunsSchedule, ShardedInit, capability, get_strategy
from trainkit_strategies.communication.comm import Comm

DIM = 8
rank_zero_only.rank = 0  # the threads share one process; warnings print once


class MetricNet(nn.Module):
    """A small regression model with a torchmetrics metric updated on every training step (its states must live
    on the device with the predictions), pipeline hooks, and two AdamW param groups."""

    def __init__(self, items: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.mse = MeanSquaredError()
        self.items = items

    def configure_model(self) -> None:
        pass

    def _loss(self, out: torch.Tensor, batch: Any) -> Any:
        loss = F.mse_loss(out.float(), batch[1].float())
        self.mse.update(out.detach().float(), batch[1].float())
        if self.items == "int":
            return {"loss": loss, "num_items": batch[1].numel()}
        if self.items == "tensor":
            return {"loss": loss, "num_items": (batch[1] > -100).sum()}
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._loss(self.net(batch[0]), batch)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> Any:
        return self._loss(output, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])


class TiedGPT(DemoGPT):
    """The demo GPT (tied embedding and head) without a Trainer to log to."""

    pipeline_validation_step = None

    def training_step(self, batch: Any, batch_idx: int) -> dict:
        x, y = batch
        return {"loss": F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten()), "num_items": y.numel()}


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return TiedGPT(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=16, warmup_steps=1, max_steps=10)


def batch_for(module: nn.Module, size: int = 8) -> Any:
    gen = torch.Generator().manual_seed(0)
    if isinstance(module, MetricNet):
        return torch.randn(size, DIM, generator=gen), torch.randn(size, 1, generator=gen)
    tokens = torch.randint(0, 16, (size, 9), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train(world: SimWorld, rank: int, name: str, options: dict, make: Any, precision: str, accumulate: int,
          clip: float | None, algorithm: str, steps: int = 2, start: str = "device") -> dict:
    """``steps`` optimizer steps and an evaluation on ``rank`` of ``world``; what the strategy held.

    ``start="host"``: the module's parameters start in host memory, as a user builds them, and the strategy moves
    them (strategies that move whole modules only: re-pointing a host parameter at device memory, as the sharding
    strategies do, works from the CPU to CUDA but not to meta)."""
    env = Environment(device=META, rank=rank, local_rank=rank, world_size=world.world_size)
    strategy = get_strategy(name, **options)
    strategy.setup_environment(env, comm=world.comm(rank))
    module = make() if start == "host" else on_device(make())
    sharded = capability(strategy, ShardedInit)
    init = sharded.init_context() if sharded is not None else contextlib.nullcontext()
    with init:
        module.configure_model()
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    policy = Precision.from_name(precision)
    strategy.setup(module, optimizer, policy)
    step = OptimizerStep(strategy, StepConfig(accumulate, clip, algorithm), policy, HookDispatch(None, module))
    batch = tuple(t.to(META) for t in batch_for(module))
    for _ in range(steps):
        for i in range(accumulate):
            step.micro_step(module, batch, i, boundary=i + 1 == accumulate)
        assert step.step() is not None
    strategy.settle()
    module.eval()
    with torch.no_grad(), strategy.forward_context():
        schedule = capability(strategy, RunsSchedule)
        if schedule is not None:
            schedule.eval_schedule(module, batch, 0, "validate")
        else:
            module.training_step(batch, 0)
    metric = getattr(module, "mse", None)
    if metric is not None:
        metric.compute()
    return {"report": strategy.memory_report()}


STRATEGIES = [
    ("single", {}), ("ddp", {"bucket_mb": 0.0005}), ("ddp", {"find_unused_parameters": True}),
    ("ddp", {"compression": "powersgd", "powersgd_warmup_steps": 1}),
    ("zero1", {"bucket_mb": 0.0005}), ("zero2", {"bucket_mb": 0.0005}),
    ("zero_offload", {"bucket_mb": 0.0005}), ("zero_offload", {"bucket_mb": 0.0005, "ratio": 0.5}),
    ("zero_offload", {"bucket_mb": 0.0005, "delayed_update": True}),
    ("zero3", {"persistence_threshold": 0}), ("zero3", {}), ("fsdp", {}), ("fsdp", {"offload": True}),
    ("fsdp", {"sync_micro_steps": False}),
]
RECIPES = [  # precision, accumulation, clip, algorithm, num_items
    ("16-mixed", 2, 1.0, "norm", "none"),
    ("bf16-mixed", 2, 0.5, "value", "int"),
    ("32", 1, 1.0, "norm", "tensor"),
]


def _ids(case: tuple) -> str:
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("case", STRATEGIES, ids=_ids)
def test_every_strategy_keeps_collectives_on_the_device(case):
    name, options = case
    for precision, accumulate, clip, algorithm, items in RECIPES:
        world = SimWorld(1 if name == "single" else 2)
        world.run(lambda r, w=world, p=precision, a=accumulate, c=clip, g=algorithm, i=items: train(
            w, r, name, options, lambda i=i: MetricNet(i), p, a, c, g))
        assert world.p2p_order_problems() == []


@pytest.mark.parametrize(("world_size", "inner", "start"), [(2, "ddp", "host"), (4, "ddp", "host"),
                                                         (4, "zero2", "device"), (4, "fsdp", "device")])
def test_pipeline_with_tied_weights_and_replicas_keeps_collectives_on_the_device(world_size, inner, start):
    """The demo GPT's tied embedding and head sit on different stages: their broadcast (from parameters built in
    host memory) and gradient sum, the stage-to-stage traffic and the inner strategy's collectives, at 2 stages
    (x 2 replicas)."""
    world = SimWorld(world_size)
    make = gpt if inner == "ddp" else MetricNet  # tied parameters need ddp replicas
    options = {"stages": 2, "microbatches": 4, "data_parallel": inner}
    with swapping_parameters() if start == "host" else contextlib.nullcontext():
        world.run(lambda r: train(world, r, "pipeline", options, make, "16-mixed", 2, 1.0, "norm", start=start))
    assert world.p2p_order_problems() == []


def test_a_weight_tied_across_stages_with_zero_replicas_is_refused_naming_the_fix():
    """ZeRO keeps a param group's gradients in one partition, so the gradient of a weight tied across stages cannot be
    held apart to be summed with its other stage's: the pipeline's setup says so and names ddp and fsdp."""
    world = SimWorld(4)
    options = {"stages": 2, "microbatches": 4, "data_parallel": "zero2"}
    with pytest.raises(ValueError, match=r"zero2 keeps every gradient of a param group in one partition.*ddp or fsdp"):
        world.run(lambda r: train(world, r, "pipeline", options, gpt, "32", 1, None, "norm"))


@pytest.mark.parametrize(("options", "message"), [
    ({"dp_replicate": 2, "data_parallel": "zero2"}, r"data_parallel='zero2' cannot run dp_replicate=2.*zero1 and zero2 "
                                                    r"shard over dp_shard alone"),
    ({"dp_shard": 2, "data_parallel": "ddp"}, r"data_parallel='ddp' cannot run .*ddp replicates"),
    ({"data_parallel": "ddp", "engine_options": {"ratio": 0.5}},
     r"engine_options \['ratio'\] are not options of 'ddp'"),
    ({"data_parallel": "ddp", "engine_options": {"find_unused_parameters": True}}, None),  # dp_replicate: the rest
    ({"tp": 2, "data_parallel": "zero1"}, r"zero1 keeps every gradient of a param group in one partition"),
])
def test_a_layout_refuses_an_engine_that_cannot_run_it_naming_the_fix(options, message):
    """And takes one that can: a replicating engine named alone replicates over what the world leaves."""
    world = SimWorld(4 if "tp" in options else 2)
    with pytest.raises(ValueError, match=message) if message else contextlib.nullcontext():
        world.run(lambda r: train(world, r, "parallel", options, gpt, "32", 1, None, "norm"))


def test_engine_options_need_the_engine_named():
    with pytest.raises(ValueError, match="engine_options are options of one engine: name it with data_parallel"):
        get_strategy("parallel", engine_options={"bucket_mb": 1.0})


PARALLEL_LAYOUTS = [(2, {"tp": 2}), (2, {"tp": 2, "sequence_parallel": False}), (4, {"tp": 2, "dp_shard": 2}),
                    (4, {"dp_replicate": 2, "dp_shard": 2}), (4, {"tp": 2, "dp_replicate": 2, "dp_shard": 1}),
                    (4, {"pp": 2, "tp": 2}), (8, {"pp": 2, "tp": 2, "dp_shard": 2}), (2, {"cp": 2}),
                    (4, {"cp": 2, "tp": 2}), (4, {"cp": 2, "dp_shard": 2, "cp_method": "all_gather"}),
                    (4, {"dp_replicate": 2, "dp_shard": 2, "data_parallel": "zero3"}),
                    (2, {"data_parallel": "zero_offload", "engine_options": {"ratio": 0.5}}),
                    (2, {"cp": 2, "cp_method": "ulysses"}), (4, {"cp": 2, "dp_shard": 2, "cp_method": "ulysses"})]


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "options"), PARALLEL_LAYOUTS,
                         ids=["-".join(f"{k}{v}" for k, v in o.items()) for _, o in PARALLEL_LAYOUTS])
def test_parallel_layouts_keep_collectives_on_the_device(world_size, options):
    """strategy="parallel" on the demo GPT (tied embedding and head, split by vocabulary): tensor- and
    sequence-parallel collectives inside forward and backward, context parallelism's ring and all-gather attention,
    FSDP units, HSDP, pipeline stages, under every
    recipe; in layouts that shard nothing, the GPT is built in host memory once (the plan cuts host parameters,
    the strategy moves the parts)."""
    dp_shard = options.get("dp_shard", world_size // options.get("tp", 1) // options.get("pp", 1)
                           // options.get("dp_replicate", 1) // options.get("cp", 1)) * options.get("cp", 1)
    starts = ("device", "host" if dp_shard == 1 else "device", "device")  # cp ranks shard parameters too
    for (precision, accumulate, clip, algorithm, _), start in zip(RECIPES, starts, strict=True):
        world = SimWorld(world_size)
        with swapping_parameters() if start == "host" else contextlib.nullcontext():
            world.run(lambda r, w=world, p=precision, a=accumulate, c=clip, g=algorithm, h=start: train(
                w, r, "parallel", {"microbatches": 2, **options}, gpt, p, a, c, g, start=h))
        assert world.p2p_order_problems() == []


@contextlib.contextmanager
def swapping_parameters() -> Any:
    """``module.to(meta)`` keeps each parameter object (torch swaps its contents), as ``.to("cuda")`` does."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


SCHEDULE_GRID = [(p, v, schedule, m) for p in (2, 3, 4) for v in (1, 2, 3)
                 for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
                 for m in (p, 2 * p, p + 1)
                 if (v == 1 or schedule in ("gpipe", "interleaved_1f1b"))
                 and not (schedule == "interleaved_1f1b" and m % p)]


@pytest.mark.parametrize(("stages", "virtual", "schedule", "microbatches"), SCHEDULE_GRID,
                         ids=[f"p{p}-v{v}-{s}-m{m}" for p, v, s, m in SCHEDULE_GRID])
def test_pipeline_schedules_issue_point_to_point_in_the_same_order_on_both_ends(stages, virtual, schedule,
                                                                            microbatches):
    """The executor's real issue order, replayed on every rank: each communicator's two ends agree, and no
    collective crosses stage-to-stage traffic in flight."""

    def make() -> MetricNet:
        module = MetricNet()
        torch.manual_seed(0)
        module.net = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(stages * virtual)],
                                   nn.Linear(DIM, 1))
        return module

    options = {"stages": stages, "microbatches": microbatches, "schedule": schedule, "virtual_stages": virtual,
               "split": [1] * (stages * virtual - 1) + [2]}
    world = SimWorld(stages)
    world.run(lambda r: train(world, r, "pipeline", options, make, "32", 2, 1.0, "norm"))
    assert world.p2p_order_problems() == []


def test_the_world_rejects_a_collective_on_a_host_tensor():
    """The harness itself: what gloo accepts and NCCL rejects is caught."""
    world = SimWorld(2)

    def rank(r: int) -> None:
        comm: Comm = world.comm(r)
        comm._count = lambda *a: None  # Comm's own check would stop it first; the harness must catch it alone
        comm.all_reduce(torch.ones(3))

    with pytest.raises(RuleViolation, match="takes only tensors on meta"):
        world.run(rank)


def test_the_world_rejects_point_to_point_issued_in_different_orders():
    world = SimWorld(2)

    def rank(r: int) -> None:
        comm = world.comm(r)
        peer = 1 - r
        first = comm.send(torch.ones(4, device=META), peer)  # both ends send first: a deadlock on NCCL
        second = comm.recv(torch.empty(4, device=META), peer)
        first.wait()
        second.wait()

    world.run(rank)
    problems = world.p2p_order_problems()
    assert problems and "operation #0 is a send" in problems[0]


def test_the_world_rejects_compute_mixing_device_and_host_tensors():
    world = SimWorld(1)

    def rank(r: int) -> None:
        grads = [torch.ones(4)]
        torch._foreach_mul_(grads, torch.ones((), device=META))  # the pre-fix offload clip-by-value

    with pytest.raises(RuleViolation, match="mixes tensors on the device"):
        world.run(rank)


def test_the_world_checks_an_uneven_all_to_all_and_moves_its_blocks():
    """What rank i sends to rank j must be what j expects from i; blocks land in order of their sources."""
    from tests.simworld import CPU

    world = SimWorld(3, device=CPU)
    rows = lambda i, j: (i + 2 * j) % 3

    def rank(r: int, expect=rows) -> torch.Tensor:
        comm = world.comm(r)
        sent = torch.cat([torch.full((rows(r, j), 2), 10.0 * r + j) for j in range(3)])
        out = torch.empty(sum(expect(i, r) for i in range(3)), 2)
        comm.all_to_all(out, sent, output_splits=[expect(i, r) for i in range(3)],
                        input_splits=[rows(r, j) for j in range(3)])
        return out

    for r, out in enumerate(world.run(rank)):
        assert torch.equal(out, torch.cat([torch.full((rows(i, r), 2), 10.0 * i + r) for i in range(3)]))
    world = SimWorld(3, device=CPU)
    with pytest.raises(RuleViolation, match="rank 1 sends 1 rows to rank 0, which expects 2"):
        world.run(lambda r: rank(r, expect=lambda i, j: rows(i, j) if (i, j) != (1, 0) else 2))


def moe() -> nn.Module:
    """examples/moe.py's Mixtral (4 experts of top 2 per layer, capacity routing), without a Trainer to log to."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from moe import Mixtral

    class Quiet(Mixtral):
        def training_step(self, batch: Any, batch_idx: int) -> dict:
            x, y = batch
            return {"loss": self._loss(self(x), y), "num_items": y.numel()}

    torch.manual_seed(0)
    return Quiet(vocab_size=16, max_seq_len=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, hidden_dim=16, experts=4,
                 capacity_factor=1.0, warmup_steps=1, max_steps=10)


EXPERT_LAYOUTS = [(2, {"ep": 2}), (4, {"ep": 2, "dp_shard": 2}), (4, {"ep": 2, "tp": 2}), (4, {"ep": 2, "pp": 2}),
                  (4, {"ep": 4})]


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "options"), EXPERT_LAYOUTS,
                         ids=["-".join(f"{k}{v}" for k, v in o.items()) for _, o in EXPERT_LAYOUTS])
def test_expert_layouts_keep_collectives_on_the_device(world_size, options):
    """Expert parallelism's all-gathered counts and all-to-alls (what each rank sends another is what that rank
    expects: on meta tensors the routing is planned balanced on every rank alike), beside FSDP, tensor and
    sequence parallelism and pipeline stages, under every recipe."""
    for precision, accumulate, clip, algorithm, _ in RECIPES:
        world = SimWorld(world_size)
        world.run(lambda r, w=world, p=precision, a=accumulate, c=clip, g=algorithm: train(
            w, r, "parallel", {"microbatches": 2, **options}, moe, p, a, c, g))
        assert world.p2p_order_problems() == []



@pytest.mark.slow
def test_hugging_face_experts_keep_collectives_on_the_device():
    """A Hugging Face Mixtral's packed experts divided over ep=2 (``experts/huggingface.py``): the same dispatcher's
    counts and all-to-alls, from transformers' router, under every recipe."""
    from tests.unit.test_hf_experts import causal_lm

    for precision, accumulate, clip, algorithm, _ in RECIPES:
        world = SimWorld(2)
        world.run(lambda r, w=world, p=precision, a=accumulate, c=clip, g=algorithm: train(
            w, r, "parallel", {"ep": 2}, lambda: causal_lm("mixtral"), p, a, c, g))
        assert world.p2p_order_problems() == []

def test_ulysses_refuses_heads_the_group_cannot_share():
    world = SimWorld(4)
    with pytest.raises(ValueError, match=r"cp_method='ulysses' gives each of the cp=4 ranks heads/cp of the heads, "
                                         r"but attention has 2: use a cp that divides 2, or cp_method='ring'"):
        world.run(lambda r: train(world, r, "parallel", {"cp": 4, "cp_method": "ulysses"}, gpt, "32", 1, None,
                                  "norm", steps=1))
