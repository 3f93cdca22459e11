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

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from trainkit.activation import apply_activation_checkpointing
from trainkit.errors import ConfigurationError
from trainkit.rehearsal import heaviest, meta_copy, plan_optimizer, to_fake
from trainkit.step import unpack_output
from trainkit.units import human, human_count, human_or_unknown, parse_bytes
from trainkit.work import tracked
from trainkit_strategies import ActivationMeter, Precision, Strategy, get_strategy
from trainkit_strategies.experts.huggingface import experts_modules, unpacked
from trainkit_strategies.experts.transform import moe_layers
from trainkit_strategies.sharding.units import repeated_layers
from trainkit_strategies.tensor.planned import plan_for

__all__ = ["AUTO_ORDER", "HEADROOM", "STRATEGIES", "Estimate", "NoBatch", "StrategyEstimate", "choose", "estimate",
           "first_batch", "human", "mesh_layouts", "meta_copy", "one_batch", "parse_bytes"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline")
AUTO_ORDER = ("ddp", "zero1", "zero2", "fsdp", "zero_offload")  # fastest first, as strategy="auto" tries them
HEADROOM = 0.9  # of device memory a plan may fill: the allocator's fragmentation and workspaces need the rest


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
    setup: int = 0  # device bytes at the peak of setup (``SetupPeak.device``: what the rank keeps, what it allocates)
    pinned: int = 0  # the page-locked part of ``host`` (what crosses the bus)
    comm_by_kind: dict[str, int] = field(default_factory=dict)  # ``comm`` by collective kind (Comm.stats's)
    rank: int = 0  # the rank planned (the heaviest: not rank 0, padding lands on the last ranks; a pipeline's stage)
    comm_by_axis: dict[str, int] = field(default_factory=dict)  # ``comm`` by the axis of the layout it ran along
    name: str = ""  # the registered strategy (``strategy`` is the row's label: a layout row's degrees)
    options: dict[str, Any] = field(default_factory=dict)  # its options (a layout row's degrees)
    activations_selective: int | None = 0  # the same under selective activation checkpointing
    setup_host: int = 0  # host bytes at the peak of setup (``SetupPeak.host``: the largest whole tensor it rebuilds)

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

    @property
    def host_need(self) -> int:
        """Host bytes: the model state kept there in training (offload), or the setup's peak when that is higher."""
        return max(self.host, self.setup_host)


@dataclass(frozen=True)
class Estimate:
    parameters: int
    world_size: int
    precision: str
    rows: list[StrategyEstimate]
    device_memory: int | None = None
    host_memory: int | None = None  # per rank
    named: str | None = None  # the row of the run's own strategy (``estimate(strategy=...)``)

    def row(self, strategy: str) -> StrategyEstimate:
        return next(r for r in self.rows if r.strategy == strategy)

    def fits(self, row: StrategyEstimate, checkpointed: bool | str | None = False) -> bool | None:
        """Whether ``row`` fits the device memory and the host memory given, within ``HEADROOM`` of each, its setup
        included (None: neither given, or the row does not apply)."""
        if (self.device_memory is None and self.host_memory is None) or not row.applies:
            return None
        device = self.device_memory is None or row.need(checkpointed) <= HEADROOM * self.device_memory
        return device and (self.host_memory is None or row.host_need <= HEADROOM * self.host_memory)

    def refuse_unfit(self, checkpointing: bool | str | None = None) -> None:
        """Raises a ``ConfigurationError`` naming the rows that fit when the run's own strategy (``named``) does not:
        a layout whose setup alone overflows its device or host memory fails here, before any rank allocates."""
        row = self.row(self.named) if self.named is not None else None
        if row is None or self.fits(row, checkpointing) is not False:
            return
        limits = " and ".join(f"{human(n)} {where}" for n, where in ((self.device_memory, "per device"),
                                                                       (self.host_memory, "of host memory a rank"))
                              if n is not None)
        others = [r.describe_choice() for r in self.rows if r is not row and self.fits(r, checkpointing)]
        raise ConfigurationError(
            f"{row.describe_choice()} does not fit in {limits} ({int(HEADROOM * 100)}% usable) at {self.world_size} "
            f"ranks: its setup peaks at {human(row.setup)} on the device and {human(row.setup_host)} in host memory "
            f"per rank, and training needs {human(row.need(checkpointing))} on the device and {human(row.host_need)} "
            f"in host memory. "
            + (f"These fit: {', '.join(others)}." if others else "Nothing planned fits: use more devices.")
            + " Pick one with --trainer.strategy, or change the degrees.")

    def table(self) -> str:
        lines = [f"{human_count(self.parameters)} parameters, {self.world_size} rank(s), precision {self.precision}"
                 + (f", device memory {human(self.device_memory)}" if self.device_memory else "")
                 + (f", host memory {human(self.host_memory)} a rank" if self.host_memory else ""),
                 f"{'strategy':<14}{'device state':>14}{'host state':>12}{'(pinned)':>11}{'activations':>13}"
                 f"{'(sel)':>11}{'(ckpt)':>11}{'setup dev':>12}{'setup host':>12}{'comm/step':>12}  fits  note"]
        for r in self.rows:
            fits = {True: "yes", False: "no", None: "-"}[self.fits(r)]
            if not r.applies:
                lines.append(f"{r.strategy:<14}{'':>118}  {'-':<4}  {r.note}")
                continue
            axes = ", ".join(f"{axis} {human(n)}" for axis, n in r.comm_by_axis.items() if n)
            note = "; ".join(x for x in (r.note, f"comm {axes}" if r.options and axes else "") if x)
            lines.append(f"{r.strategy:<14}{human(r.device):>14}{human(r.host):>12}{human(r.pinned):>11}"
                         f"{human_or_unknown(r.activations):>13}{human_or_unknown(r.activations_selective):>11}"
                         f"{human_or_unknown(r.activations_checkpointed):>11}{human(r.setup):>12}{human(r.setup_host):>12}"
                         f"{human_or_unknown(r.comm):>12}  {fits:<4}  {note}")
        if any(r.applies and r.activations is None for r in self.rows):
            lines.append("activations and comm/step are unknown without a batch to trace: pass --data (a DataModule)"
                         " or give the model a train_dataloader(); in Python, estimate(model, batch).")
        return "\n".join(lines)


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
            to_fake(model, device_type, dtypes)
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



def estimate(module: nn.Module, batch: Any, world_size: int = 1, precision: str = "32",
             strategies: Sequence[str] = STRATEGIES, device_memory: str | int | None = None,
             activation_checkpointing: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | str | None = None,
             device_type: str = "cpu", layouts: Sequence[Mapping[str, int]] | None = None,
             devices_per_node: int | None = None, activation_checkpointing_every: int = 1,
             host_memory: str | int | None = None, strategy: Strategy | None = None) -> Estimate:
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
        host_memory: bytes of host memory per rank ("64GB") to say which plans fit, their setup included.
        strategy: the run's own strategy (a built one, its options set): planned as the row named after it (in
            place of that name's row), which ``Estimate.refuse_unfit`` checks.
    """
    if not getattr(module, "automatic_optimization", True):
        batch = None
    module = meta_copy(module)
    with torch.device("meta"):  # layers built there are planned as they are, never allocated
        module.configure_model()
    policy = Precision.from_name(precision)
    trace_on = device_type if device_type == "cpu" or torch.cuda.is_available() else "cpu"
    traced: dict[tuple, tuple[int, int, int]] = {}  # per set of parameter dtypes a strategy computes with
    optimizer = plan_optimizer(meta_copy(module))
    if layouts is None:
        layouts = mesh_layouts(module, world_size, devices_per_node)
    candidates: list[tuple[str, str, dict, Strategy | None]] = [(name, name, {}, None) for name in strategies]
    candidates += [(layout_label(degrees, world_size), "parallel", dict(degrees), None) for degrees in layouts]
    named = None if strategy is None else strategy.name
    if strategy is not None:
        candidates = [(named, named, {}, strategy)] + [c for c in candidates if c[0] != named]
    rows = []
    for label, name, options, given in tracked(candidates, f"planning {len(candidates)} strategies and layouts "
                                                           f"at {world_size} ranks", label=lambda c: c[0]):
        try:
            strategy = given if given is not None else get_strategy(name, **options)
            unfit = strategy.unfit_for(module, optimizer)
            if unfit is not None:
                rows.append(StrategyEstimate(label, note=f"n/a: {unfit}", name=name, options=options))
                continue
            strategy, setup_peak, moved = heaviest(strategy, module, policy, world_size, batch, device_type,
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
                                     strategy.describe(), setup_peak.device, report.pinned, moved["kind"],
                                     strategy.rank, moved["axis"] if batch is not None else {}, name, options,
                                     selective, setup_peak.host))
    params = sum(p.numel() for p in module.parameters())
    memory = parse_bytes(device_memory) if device_memory is not None else None
    host = parse_bytes(host_memory) if host_memory is not None else None
    return Estimate(params, world_size, policy.name, rows, memory, host, named)


def mesh_layouts(module: nn.Module, world_size: int, devices_per_node: int | None = None) -> list[dict[str, int]]:
    """The layouts worth planning for ``module`` on ``world_size`` ranks: tensor parallelism of 2, 4 or 8 within a
    node (when the module has a plan: its ``tensor_parallel_plan()``, a Hugging Face model's own) times 1, 2 or 4
    pipeline stages (when it has ``pipeline_layers()`` with as many layers), the data-parallel shards taking the
    rest (without tensor parallelism the layout is ``fsdp`` or ``pipeline``, already rows); and with MoE layers
    (trainkit's, or Hugging Face blocks ep divides), their experts divided over 2, 4 or 8 of the data-parallel ranks
    (``ep``)."""
    experts = {m.num_experts for m in moe_layers(module)} | \
        {e.gate_up_proj.shape[0] for _, _, e in experts_modules(module) if unpacked(e) is None}  # Hugging Face's
    expert_parallel = [{"ep": ep} for ep in (2, 4, 8) if experts and world_size % ep == 0
                       and all(n % ep == 0 for n in experts)]  # the experts divided among data-parallel ranks
    try:
        planned = plan_for(module) is not None
    except ValueError:  # a plan trainkit cannot run: its rows say why (the strategy's unfit_for)
        planned = True
    if not planned:
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
    by_name = sorted((r for r in plan.rows if r.strategy in AUTO_ORDER), key=lambda r: AUTO_ORDER.index(r.strategy))
    rows = [row for row in by_name + [r for r in plan.rows if r.options] if row.applies]
    for row in rows:
        if plan.fits(row, checkpointing):
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
