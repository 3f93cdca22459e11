"""Plan before you run: per-rank memory and communication of every strategy, without allocating the model.

``estimate()`` builds nothing real. The module's parameters live on the meta device; each strategy is set
up on a copy of it exactly as in training (same buckets, padding, shards, offload placement), at the
rank and world size asked for, with a ``PlanComm`` that counts every byte and moves none, and takes one
optimizer step as a run takes it. Its ``memory_report()`` at that step's peak (gradients held, optimizer state
created) gives the model-state bytes on the device and on the host; the setup's peak is measured while it
builds its buckets or shards (``LiveBytes``); the step's bytes per collective kind are what its own code issued
(padding, buffer broadcasts, compression, a pipeline's activations, a persistent unit gathered once), and by the
axis of the layout they ran along. Beside the strategies by name, layout rows plan ``strategy="parallel"`` at each
tp x pp x dp_shard the world allows (tp within a node). The planner asks each strategy what it needs
(``unfit_for``), how it would run the module (``planned``: a pipeline's depth, the ranks worth planning), what its
rank computes (``activation_model``: tensor-parallel slices) and what to say of it (``describe``): it knows no
strategy by name.
Activations are the bytes autograd saves for backward in one micro-batch's ``training_step`` traced with fake
tensors (``ActivationMeter``) under the precision's autocast, with each parameter in the dtype the strategy
computes with, with and without activation checkpointing.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from trainkit.activation import apply_activation_checkpointing
from trainkit.manual import strategy_optimizer
from trainkit.module import TrainModule
from trainkit.optim import parse_optimizers
from trainkit.step import unpack_output
from trainkit.units import human, human_count, human_or_unknown, parse_bytes
from trainkit.work import tracked
from trainkit_strategies import (
    ActivationMeter,
    Environment,
    Precision,
    RunsSchedule,
    Strategy,
    capability,
    get_strategy,
)
from trainkit_strategies.communication.plan_comm import PlanComm
from trainkit_strategies.context.huggingface import without_masks
from trainkit_strategies.experts.transform import moe_layers
from trainkit_strategies.planning.memory import LiveBytes
from trainkit_strategies.sharding.units import repeated_layers
from trainkit_strategies.tensor.planned import plan_for

STRATEGIES = ("ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline")
AUTO_ORDER = ("ddp", "zero1", "zero2", "fsdp", "zero_offload")  # fastest first, as strategy="auto" tries them
HEADROOM = 0.9  # of device memory a plan may fill: the allocator's fragmentation and workspaces need the rest
META = torch.device("meta")


@dataclass(frozen=True)
class StrategyEstimate:
    """One strategy's plan at the estimate's world size, per rank (bytes)."""

    strategy: str
    device: int = 0  # model state on the device: parameters, gradients, master weights, optimizer state, buffers
    host: int = 0  # model state in host memory (offload)
    activations: int | None = 0  # saved for backward, one micro-batch (None: unknown, no batch to trace)
    activations_checkpointed: int | None = 0  # the same under full activation checkpointing
    comm: int | None = 0  # payload per optimizer step, as the strategy's own step issued it (None: no batch)
    detail: dict[str, int] = field(default_factory=dict)  # device bytes by category
    note: str = ""  # the pipeline's stage split, or why the strategy does not apply
    setup: int = 0  # device bytes at the peak of setup (measured while the strategy builds its buckets or shards)
    pinned: int = 0  # the page-locked part of ``host`` (what crosses the bus)
    comm_by_kind: dict[str, int] = field(default_factory=dict)  # ``comm`` by collective kind (Comm.stats's)
    rank: int = 0  # the rank planned (the heaviest: not rank 0, padding lands on the last ranks; a pipeline's stage)
    comm_by_axis: dict[str, int] = field(default_factory=dict)  # ``comm`` by the axis of the layout it ran along
    name: str = ""  # the registered strategy (``strategy`` is the row's label: a layout row's degrees)
    options: dict[str, Any] = field(default_factory=dict)  # its options (a layout row's degrees)
    activations_selective: int | None = 0  # the same under selective activation checkpointing

    @property
    def registered(self) -> str:
        return self.name or self.strategy

    def describe_choice(self) -> str:
        return f"{self.registered} ({self.strategy})" if self.options else self.strategy

    @property
    def applies(self) -> bool:
        return not self.note.startswith("n/a")

    def activations_under(self, checkpointing: bool | str | None) -> int | None:
        """One micro-batch's activations without checkpointing (False, None), under full checkpointing (True,
        "full") or under selective checkpointing ("selective")."""
        if checkpointing == "selective":
            return self.activations_selective
        return self.activations_checkpointed if checkpointing else self.activations

    def need(self, checkpointed: bool | str | None = False) -> int:
        """Device bytes for training: model state plus one micro-batch's activations (as ``activations_under``
        says; none when unknown), or the setup's peak when that is higher."""
        return max(self.setup, self.device + (self.activations_under(checkpointed) or 0))

    @property
    def peak(self) -> int:
        return self.need()


@dataclass(frozen=True)
class Estimate:
    parameters: int
    world_size: int
    precision: str
    rows: list[StrategyEstimate]
    device_memory: int | None = None

    def row(self, strategy: str) -> StrategyEstimate:
        return next(r for r in self.rows if r.strategy == strategy)

    def fits(self, row: StrategyEstimate) -> bool | None:
        if self.device_memory is None or not row.applies:
            return None
        return row.peak <= HEADROOM * self.device_memory

    def table(self) -> str:
        lines = [f"{human_count(self.parameters)} parameters, {self.world_size} rank(s), precision {self.precision}"
                 + (f", device memory {human(self.device_memory)}" if self.device_memory else ""),
                 f"{'strategy':<14}{'device state':>14}{'host state':>12}{'(pinned)':>11}{'activations':>13}"
                 f"{'(sel)':>11}{'(ckpt)':>11}{'setup peak':>12}{'comm/step':>12}  fits  note"]
        for r in self.rows:
            fits = {True: "yes", False: "no", None: "-"}[self.fits(r)]
            if not r.applies:
                lines.append(f"{r.strategy:<14}{'':>106}  {'-':<4}  {r.note}")
                continue
            axes = ", ".join(f"{axis} {human(n)}" for axis, n in r.comm_by_axis.items() if n)
            note = "; ".join(x for x in (r.note, f"comm {axes}" if r.options and axes else "") if x)
            lines.append(f"{r.strategy:<14}{human(r.device):>14}{human(r.host):>12}{human(r.pinned):>11}"
                         f"{human_or_unknown(r.activations):>13}{human_or_unknown(r.activations_selective):>11}"
                         f"{human_or_unknown(r.activations_checkpointed):>11}{human(r.setup):>12}"
                         f"{human_or_unknown(r.comm):>12}  {fits:<4}  {note}")
        if any(r.applies and r.activations is None for r in self.rows):
            lines.append("activations and comm/step are unknown without a batch to trace: pass --data (a DataModule)"
                         " or give the model a train_dataloader(); in Python, estimate(model, batch).")
        return "\n".join(lines)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors of the same shapes (nothing of their data
    is copied). It shares the module's Trainer, if any, so that ``self.trainer`` reads as in the run (under
    ``strategy="auto"`` the planner traces ``training_step`` as fit starts), but it is marked as planned: its
    ``self.log`` records nothing there and its ``device`` is its parameters'."""
    memo: dict[int, Any] = {}
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = trainer
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device=META)
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        if isinstance(sub, TrainModule):
            sub._planned = True
    return copied


def _optimizer(module: nn.Module) -> Optimizer:
    try:
        return strategy_optimizer(parse_optimizers(module.configure_optimizers()))
    except Exception:  # configure_optimizers may need a Trainer; plan with plain AdamW then
        return torch.optim.AdamW(module.parameters())


def _activations(module: nn.Module, batch: Any, precision: Precision, device_type: str,
                 policy: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | str | None,
                 dtypes: dict[str, torch.dtype] | None = None,
                 rewrite: Callable[[nn.Module], nn.Module] = lambda m: m, every: int = 1) -> tuple[int, int, int]:
    """Bytes saved for backward by one ``training_step`` on ``batch``: plain, under full checkpointing and under
    selective checkpointing (of the modules ``policy`` selects, the repeated blocks by default, one in ``every``),
    traced with fake tensors on ``device_type`` (so autocast applies as it will; no memory is used), with each parameter
    in the dtype ``dtypes`` gives it (what a strategy computes with: under bf16-mixed ddp keeps fp32 parameters, whose
    bf16 copies autocast saves for backward, where the ZeRO stages and FSDP compute with bf16 working parameters and
    save nothing extra), and the batch as the precision feeds it (bf16 under "bf16-true"). ``rewrite`` turns the meta
    copy into what one rank computes (a strategy's ``activation_model``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def trace(model: nn.Module) -> int:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            _to_fake(model, device_type, dtypes)
            fake = apply_to_collection(batch, torch.Tensor, lambda t: mode.from_tensor(t.to(device_type)))
            fake = precision.convert_input(fake)
            model.train()
            with ActivationMeter(exclude=model.parameters()) as meter, \
                    precision.forward_context(torch.device(device_type)):
                loss, _ = unpack_output(model.training_step(fake, 0))
        return meter.bytes if loss is not None else 0

    plain = trace(rewrite(meta_copy(module)))
    if isinstance(policy, str):
        policy = None  # "full" and "selective" name the repeated blocks; both columns are traced
    traced = []
    for mode in ("full", "selective"):
        checkpointed = rewrite(meta_copy(module))
        if policy is None:
            repeated = {id(m) for m in repeated_layers(checkpointed)}
            selects = lambda m, ids=repeated: id(m) in ids  # the blocks FSDP would wrap
        else:
            selects = policy
        try:
            apply_activation_checkpointing(checkpointed, selects, mode=mode, every=every)
        except ValueError:
            return plain, plain, plain  # nothing to checkpoint
        traced.append(trace(checkpointed))
    return plain, traced[0], traced[1]


def _to_fake(model: nn.Module, device: str, dtypes: dict[str, torch.dtype] | None) -> None:
    """``model``'s meta parameters and buffers replaced by fake tensors on ``device`` (under a ``FakeTensorMode``),
    each parameter in the dtype ``dtypes`` gives it. Made from their shapes, not by ``to_empty``: a fake mode first
    converts a meta tensor passed to an operation into a fake one, which was a third of a trace's time."""
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    for name, p in model.named_parameters():
        if dtypes and name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])


def _setup(strategy: Strategy, module: nn.Module, precision: Precision, world_size: int, rank: int,
           device_type: str = "cpu", devices_per_node: int | None = None) -> tuple[Any, nn.Module, int]:
    """``strategy`` (a fresh copy of the planned one) set up on a meta copy of ``module`` as rank ``rank`` of
    ``world_size`` with a ``PlanComm`` (every byte counted, none moved). Returns the strategy, its model and the most
    device bytes its setup held at once. Host memory is on the meta device too; on ``device_type`` "cuda" it is laid
    out as apart from the device's."""
    model = meta_copy(module)
    strategy = copy.deepcopy(strategy)
    env = Environment(device=META, rank=rank, local_rank=rank, world_size=world_size, host=META,
                      separate_host=device_type == "cuda", local_world_size=devices_per_node or 0)
    strategy.setup_environment(env, comm=PlanComm(world_size, rank, META))
    with LiveBytes(META) as setup:
        strategy.setup(model, _optimizer(model), precision)
    without_masks(model)  # Hugging Face models: no mask made (its code reads values a meta tensor has none of)
    return strategy, model, setup.peak


def _step(strategy: Any, model: nn.Module, module: nn.Module, batch: Any, precision: Precision, trace_on: str,
          crossing: dict | None) -> dict[str, dict[str, int]]:
    """One optimizer step of a set-up strategy taken as a run takes it (forward and backward of ``batch`` or the
    pipeline's schedule, the reduction, the update), left at its peak: gradients still held, the optimizer state
    created. Returns the bytes the step's collectives and transfers carried, by kind and by axis. Without a batch the
    backward is a synthetic one that touches every parameter (model state as in a run; the bytes then leave out
    what depends on the data)."""
    comms = strategy.comms()
    for comm in comms:
        comm.stats.reset()
    if strategy.optimizer is not None:
        model.train()
        _one_step(strategy, model, module, batch, precision, trace_on, crossing)
    moved: dict[str, dict[str, int]] = {"kind": {}, "axis": {}}
    for comm in comms:
        for kind, n in comm.stats.bytes.items():
            moved["kind"][kind] = moved["kind"].get(kind, 0) + n
    seen: set[int] = set()
    for axis, on_axis in strategy.comms_by_axis().items():
        for comm in on_axis:
            if id(comm) not in seen:
                seen.add(id(comm))
                moved["axis"][axis] = moved["axis"].get(axis, 0) + sum(comm.stats.bytes.values())
    return moved


def _one_step(strategy: Any, model: nn.Module, module: nn.Module, batch: Any, precision: Precision,
              trace_on: str, crossing: dict | None) -> None:
    meta_batch = None if batch is None else \
        precision.convert_input(apply_to_collection(batch, torch.Tensor, lambda t: t.to(META)))
    schedule = capability(strategy, RunsSchedule)
    if schedule is not None and meta_batch is not None:
        if crossing is None:
            crossing = _crossing(strategy, module, batch, precision, trace_on)
        schedule.expect(crossing)
        schedule.run_schedule(model, meta_batch, 1.0)
    elif meta_batch is not None and schedule is None:
        with strategy.forward_context():  # on the rank's tokens (its chunks of every sequence under cp)
            loss, _ = unpack_output(model.training_step(strategy.local_batch(meta_batch), 0))
            if loss is not None:
                strategy.backward(loss)
    else:  # no data: a backward that reaches every trainable parameter this rank runs
        params = strategy.trainable()
        if params:
            strategy.backward(torch.stack([p.sum() for p in params]).sum() * 0)
    strategy.reduce_gradients(1.0)
    strategy.optimizer_step()  # its collectives counted, its state created; gradients are still held


def _crossing(strategy: Any, module: nn.Module, batch: Any, precision: Precision, trace_on: str,
              dtypes: dict[str, torch.dtype] | None = None) -> dict:
    """What crosses a planned pipeline's boundaries, traced with fake tensors where autocast runs as in the run, with
    the parameters in the dtypes the stages compute with (the dtype of an activation crossing a boundary is the
    forward's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    full = strategy.activation_model(meta_copy(module), torch.device(trace_on))  # as a rank computes it
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        _to_fake(full, trace_on, dtypes)  # in the dtypes the stages compute with
        fake = precision.convert_input(
            apply_to_collection(batch, torch.Tensor, lambda t: mode.from_tensor(t.to(trace_on))))
        with torch.no_grad(), precision.forward_context(torch.device(trace_on)):
            return capability(strategy, RunsSchedule).crossing(full, fake)


def estimate(module: nn.Module, batch: Any, world_size: int = 1, precision: str = "32",
             strategies: Sequence[str] = STRATEGIES, device_memory: str | int | None = None,
             activation_checkpointing: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | str | None = None,
             device_type: str = "cpu", layouts: Sequence[Mapping[str, int]] | None = None,
             devices_per_node: int | None = None, activation_checkpointing_every: int = 1) -> Estimate:
    """Plan ``module`` (built on the meta device: ``with torch.device("meta"): module = MyModule()``; a real
    module is copied there) on ``world_size`` ranks, one row per strategy and per layout.

    Args:
        batch: one micro-batch as a rank sees it (any device; only its shapes and dtypes matter), or None: the
            model-state columns only (activations and the step's bytes depend on the data). A module under manual
            optimization is planned without it: its ``training_step`` runs backwards and steps itself.
        precision: the Trainer's precision.
        device_memory: bytes per device ("80GB") to say which plans fit (with 10% headroom).
        activation_checkpointing: the modules of the checkpointed columns, "(sel)" (selective recomputation) and
            "(ckpt)" (full): module classes or a ``module -> bool`` policy; default (or "full", "selective"): the
            repeated blocks.
        device_type: "cpu" or "cuda": the device the run will train on (a GPU's host memory is apart from its own:
            offload's page-locked copies and device scratch); activations are traced with its autocast when it is
            available here, else on the CPU.
        layouts: degrees of ``strategy="parallel"`` to plan (``{"tp": 2, "pp": 2}``; ``dp_shard`` takes the rest);
            default: those ``mesh_layouts`` finds for the module; ``[]``: none.
        devices_per_node: ranks per node (default: the world): a tensor-parallel group stays within one.
        activation_checkpointing_every: checkpoint one selected module in this many (the Trainer's option).
    """
    if not getattr(module, "automatic_optimization", True):
        batch = None
    module = meta_copy(module)
    module.configure_model()
    policy = Precision.from_name(precision)
    trace_on = device_type if device_type == "cpu" or torch.cuda.is_available() else "cpu"
    traced: dict[tuple, tuple[int, int, int]] = {}  # per set of parameter dtypes a strategy computes with
    optimizer = _optimizer(meta_copy(module))
    if layouts is None:
        layouts = mesh_layouts(module, world_size, devices_per_node)
    candidates = [(name, name, {}) for name in strategies]
    candidates += [(layout_label(degrees, world_size), "parallel", dict(degrees)) for degrees in layouts]
    rows = []
    for label, name, options in tracked(candidates, f"planning {len(candidates)} strategies and layouts "
                                                    f"at {world_size} ranks", label=lambda c: c[0]):
        try:
            strategy = get_strategy(name, **options)
            unfit = strategy.unfit_for(module, optimizer)
            if unfit is not None:
                rows.append(StrategyEstimate(label, note=f"n/a: {unfit}", name=name, options=options))
                continue
            strategy, setup_peak, moved = _heaviest(strategy, module, policy, world_size, batch, device_type,
                                                    trace_on, devices_per_node)
        except ValueError as err:  # a layout the model does not divide into (heads, layers), say
            rows.append(StrategyEstimate(label, note=f"n/a: {err}", name=name, options=options))
            continue
        plain = checkpointed = selective = None
        if batch is not None:
            dtypes = {n: p.dtype for n, p in strategy.module.named_parameters()}
            rewritten = type(strategy).activation_model is not Strategy.activation_model
            key = (tuple(sorted((n, str(d)) for n, d in dtypes.items())), label if rewritten else "")
            if key not in traced:
                rewrite = lambda m, s=strategy: s.activation_model(m, torch.device(trace_on))
                traced[key] = _activations(module, strategy.local_batch(batch), policy, trace_on,
                                           activation_checkpointing, dtypes, rewrite, activation_checkpointing_every)
            plain, checkpointed, selective = traced[key]
        report = strategy.memory_report()
        rows.append(StrategyEstimate(label, report.device_total, report.host_total, plain, checkpointed,
                                     sum(moved["kind"].values()) if batch is not None else None, dict(report.device),
                                     strategy.describe(), setup_peak, report.pinned, moved["kind"], strategy.rank,
                                     moved["axis"] if batch is not None else {}, name, options, selective))
    params = sum(p.numel() for p in module.parameters())
    memory = parse_bytes(device_memory) if device_memory is not None else None
    return Estimate(params, world_size, policy.name, rows, memory)


def mesh_layouts(module: nn.Module, world_size: int, devices_per_node: int | None = None) -> list[dict[str, int]]:
    """The layouts worth planning for ``module`` on ``world_size`` ranks: tensor parallelism of 2, 4 or 8 within a
    node (when the module has a plan: its ``tensor_parallel_plan()``, a Hugging Face model's own) times 1, 2 or 4
    pipeline stages (when it has ``pipeline_layers()`` with as many layers), the data-parallel shards taking the
    rest (without tensor parallelism the layout is ``fsdp`` or ``pipeline``, already rows); and with MoE layers,
    their experts divided over 2, 4 or 8 of the data-parallel ranks (``ep``)."""
    experts = {m.num_experts for m in moe_layers(module)}
    expert_parallel = [{"ep": ep} for ep in (2, 4, 8) if experts and world_size % ep == 0
                       and all(n % ep == 0 for n in experts)]  # the experts divided among data-parallel ranks
    if plan_for(module) is None:
        return expert_parallel
    node = devices_per_node or world_size
    layers = len(module.pipeline_layers()) if callable(getattr(module, "pipeline_layers", None)) else 1
    return [{"tp": tp, "pp": pp} for pp in (1, 2, 4) if pp <= layers for tp in (2, 4, 8)
            if node % tp == 0 and world_size % (tp * pp) == 0] + expert_parallel


def layout_label(degrees: Mapping[str, int], world_size: int) -> str:
    """``{"tp": 2, "pp": 2}`` at 8 ranks -> "pp2 tp2 dp2" (dp: the sharded data-parallel rest)."""
    tp, pp, replicate = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("dp_replicate", 1)
    cp, ep = degrees.get("cp", 1), degrees.get("ep", 1)
    shard = degrees.get("dp_shard") or world_size // max(1, tp * pp * replicate * cp * ep)
    parts = [f"pp{pp}" if pp > 1 else "", f"tp{tp}" if tp > 1 else "", f"cp{cp}" if cp > 1 else "",
             f"ep{ep}" if ep > 1 else "", f"rep{replicate}" if replicate > 1 else "", f"dp{shard}" if shard > 1 else ""]
    return " ".join(p for p in parts if p) or "parallel"


def _heaviest(strategy: Strategy, module: nn.Module, precision: Precision, world_size: int, batch: Any,
              device_type: str, trace_on: str,
              devices_per_node: int | None = None) -> tuple[Any, int, dict[str, dict[str, int]]]:
    """The strategy as set up on the rank that holds the most, of the ranks it says differ (``planned``). A schedule
    is planned with what crosses its boundaries, traced once, after every stage is set up (each converts its own
    parameters to the dtypes it computes with) and before any steps."""
    planned, ranks = strategy.planned(module, world_size)
    built = [_setup(planned, module, precision, world_size, r, device_type, devices_per_node) for r in ranks]
    crossing = None
    if capability(planned, RunsSchedule) is not None and batch is not None:  # stages' parameters in compute dtypes
        initial = {n: p.dtype for n, p in module.named_parameters()}
        dtypes = dict(initial)
        for stage, _, _ in built:  # a stage converts its own parameters only
            dtypes |= {n: p.dtype for n, p in stage.module.named_parameters() if p.dtype != initial.get(n, p.dtype)}
        crossing = _crossing(built[0][0], module, batch, precision, trace_on, dtypes)
    setups = [(s, peak, _step(s, model, module, batch, precision, trace_on, crossing)) for s, model, peak in built]
    return max(setups, key=lambda s: s[0].memory_report().device_total)


def one_batch(module: nn.Module, data: Any = None) -> Any:
    """The first training batch of ``data`` (a DataModule) or of the module's own ``train_dataloader``."""
    source = data if data is not None else module
    if data is not None:
        data.setup("fit")
    loader = source.train_dataloader()
    if loader is None:
        raise NoBatch("estimate needs one training batch to trace activations: pass --data, or implement "
                      "train_dataloader() on the module.")
    return first_batch(loader)


class NoBatch(ValueError):
    """The model has no data to take a batch from (``trainkit estimate`` then plans model state only)."""


def first_batch(loader: Any) -> Any:
    return next(iter(loader))


def choose(plan: Estimate, checkpointing: bool | str | None) -> StrategyEstimate:
    """What ``strategy="auto"`` takes: the first of ``AUTO_ORDER`` (fastest first), then of the layout rows (tensor
    parallelism, then pipelines), whose model state and one micro-batch's activations fit the device memory with
    headroom (activations as ``checkpointing`` says: False, "full" or "selective"); raises, naming the smallest
    plan, if none does."""
    assert plan.device_memory is not None
    limit = HEADROOM * plan.device_memory

    by_name = sorted((r for r in plan.rows if r.strategy in AUTO_ORDER), key=lambda r: AUTO_ORDER.index(r.strategy))
    rows = [row for row in by_name + [r for r in plan.rows if r.options] if row.applies]
    for row in rows:
        if row.need(checkpointing) <= limit:
            return row
    smallest = min(rows, key=lambda row: row.need(checkpointing))
    activations = smallest.activations_under(checkpointing)
    raise ValueError(
        f"No strategy fits in {human(plan.device_memory)} per device ({int(HEADROOM * 100)}% usable): the smallest "
        f"plan is {smallest.describe_choice()} with {human(smallest.need(checkpointing))} per rank (model state "
        f"{human(smallest.device)}, activations {human(activations)}, setup peak {human(smallest.setup)}) at "
        f"{plan.world_size} ranks. Use more devices, activation checkpointing, a smaller batch, or another strategy "
        "by name (zero3, pipeline).")


def device_memory_of(device: torch.device) -> int:
    """The memory one rank may plan on: the GPU's, or on the CPU the machine's divided among its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks)
