"""Plan before you run: per-rank memory and communication of every strategy, without allocating the model.

``estimate()`` builds nothing real. The module's parameters live on the meta device; each strategy is set
up on a copy of it exactly as in training (same buckets, padding, shards, offload placement), at the
rank and world size asked for, with a ``PlanComm`` that counts every byte and moves none, and takes one
optimizer step as a run takes it. Its ``memory_report()`` at that step's peak (gradients held, optimizer state
created) gives the model-state bytes on the device and on the host; the setup's peak is measured while it
builds its buckets or shards (``LiveBytes``); the step's bytes per collective kind are what its own code issued
(padding, buffer broadcasts, compression, a pipeline's activations, a persistent unit gathered once).
Activations are the bytes autograd saves for backward in one micro-batch's ``training_step`` traced with fake
tensors (``ActivationMeter``) under the precision's autocast, with each parameter in the dtype the strategy
computes with, with and without activation checkpointing.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from trainkit.activation import apply_activation_checkpointing
from trainkit.optim import parse_optimizers
from trainkit.step import unpack_output
from trainkit_strategies import ActivationMeter, Environment, Precision, RunsSchedule, SelfReducing, get_strategy
from trainkit_strategies.comm import PlanComm
from trainkit_strategies.memory import LiveBytes
from trainkit_strategies.sharding.fsdp import FSDPStrategy

STRATEGIES = ("ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline")
AUTO_ORDER = ("ddp", "zero1", "zero2", "fsdp", "zero_offload")  # fastest first, as strategy="auto" tries them
HEADROOM = 0.9  # of device memory a plan may fill: the allocator's fragmentation and workspaces need the rest
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}
META = torch.device("meta")


def parse_bytes(size: str | int | float) -> int:
    """Bytes in ``size``: a number, or a string such as "80GB", "24GiB", "512MB"."""
    if isinstance(size, int | float):
        return int(size)
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", size)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"Cannot read the size {size!r}; write it like 80GB, 24GiB or 512MB.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _count(n: int) -> str:
    return next((f"{n / size:.2f}{unit}" for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= size), str(n))


def _maybe(n: float | None) -> str:
    return "?" if n is None else human(n)


def human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class StrategyEstimate:
    """One strategy's plan at the estimate's world size, per rank (bytes)."""

    strategy: str
    device: int = 0  # model state on the device: parameters, gradients, master weights, optimizer state, buffers
    host: int = 0  # model state in host memory (offload)
    activations: int | None = 0  # saved for backward, one micro-batch (None: unknown, no batch to trace)
    activations_checkpointed: int | None = 0  # the same under activation checkpointing
    comm: int | None = 0  # payload per optimizer step, as the strategy's own step issued it (None: no batch)
    detail: dict[str, int] = field(default_factory=dict)  # device bytes by category
    note: str = ""  # the pipeline's stage split, or why the strategy does not apply
    setup: int = 0  # device bytes at the peak of setup (measured while the strategy builds its buckets or shards)
    pinned: int = 0  # the page-locked part of ``host`` (what crosses the bus)
    comm_by_kind: dict[str, int] = field(default_factory=dict)  # ``comm`` by collective kind (Comm.stats's)
    rank: int = 0  # the rank planned (the heaviest: not rank 0, padding lands on the last ranks; a pipeline's stage)

    @property
    def applies(self) -> bool:
        return not self.note.startswith("n/a")

    def need(self, checkpointed: bool = False) -> int:
        """Device bytes for training: model state plus one micro-batch's activations (checkpointed or not; none when
        unknown), or the setup's peak when that is higher."""
        activations = self.activations_checkpointed if checkpointed else self.activations
        return max(self.setup, self.device + (activations or 0))

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
        lines = [f"{_count(self.parameters)} parameters, {self.world_size} rank(s), precision {self.precision}"
                 + (f", device memory {human(self.device_memory)}" if self.device_memory else ""),
                 f"{'strategy':<13}{'device state':>14}{'host state':>12}{'(pinned)':>11}{'activations':>13}"
                 f"{'(ckpt)':>11}{'setup peak':>12}{'comm/step':>12}  fits  note"]
        for r in self.rows:
            fits = {True: "yes", False: "no", None: "-"}[self.fits(r)]
            if not r.applies:
                lines.append(f"{r.strategy:<13}{'':>95}  {'-':<4}  {r.note}")
                continue
            lines.append(f"{r.strategy:<13}{human(r.device):>14}{human(r.host):>12}{human(r.pinned):>11}"
                         f"{_maybe(r.activations):>13}{_maybe(r.activations_checkpointed):>11}{human(r.setup):>12}"
                         f"{_maybe(r.comm):>12}  {fits:<4}  {r.note}")
        if any(r.applies and r.activations is None for r in self.rows):
            lines.append("activations and comm/step are unknown without a batch to trace: pass --data (a DataModule)"
                         " or give the model a train_dataloader(); in Python, estimate(model, batch).")
        return "\n".join(lines)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors of the same shapes (nothing of their data
    is copied), detached from any Trainer."""
    memo: dict[int, Any] = {}
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        memo[id(trainer)] = None
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device=META)
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _optimizer(module: nn.Module) -> Optimizer:
    try:
        return parse_optimizers(module.configure_optimizers()).optimizer
    except Exception:  # configure_optimizers may need a Trainer; plan with plain AdamW then
        return torch.optim.AdamW(module.parameters())


def _activations(module: nn.Module, batch: Any, precision: Precision, device_type: str,
                 policy: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None,
                 dtypes: dict[str, torch.dtype] | None = None) -> tuple[int, int]:
    """Bytes saved for backward by one ``training_step`` on ``batch``, plain and checkpointed, traced with fake
    tensors on ``device_type`` (so autocast applies as it will; no memory is used), with each parameter in the
    dtype ``dtypes`` gives it (what a strategy computes with: under bf16-mixed ddp keeps fp32 parameters, whose
    bf16 copies autocast saves for backward, where the ZeRO stages and FSDP compute with bf16 working parameters
    and save nothing extra), and the batch as the precision feeds it (bf16 under "bf16-true")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def trace(model: nn.Module) -> int:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model.to_empty(device=device_type)
            for name, p in model.named_parameters():
                if dtypes is not None and name in dtypes and p.dtype != dtypes[name]:
                    p.data = p.data.to(dtypes[name])
            fake = apply_to_collection(batch, torch.Tensor, lambda t: mode.from_tensor(t.to(device_type)))
            fake = precision.convert_input(fake)
            model.train()
            with ActivationMeter(exclude=model.parameters()) as meter, \
                    precision.forward_context(torch.device(device_type)):
                loss, _ = unpack_output(model.training_step(fake, 0))
        return meter.bytes if loss is not None else 0

    plain = trace(meta_copy(module))
    checkpointed = meta_copy(module)
    if policy is None:
        repeated = set(FSDPStrategy._repeated_layers(checkpointed))
        policy = lambda m: m in repeated  # the blocks FSDP would wrap
    try:
        apply_activation_checkpointing(checkpointed, policy)
    except ValueError:
        return plain, plain  # nothing to checkpoint
    return plain, trace(checkpointed)


def _setup(name: str, module: nn.Module, precision: Precision, world_size: int, rank: int, batch: Any,
           device_type: str = "cpu", trace_on: str = "cpu", crossing: dict | None = None,
           **options: Any) -> tuple[Any, int, dict[str, int]]:
    """``name`` set up on a meta copy of ``module`` as rank ``rank`` of ``world_size`` with a ``PlanComm`` (every byte
    counted, none moved), then one optimizer step taken as a run takes it (forward and backward of ``batch`` or the
    pipeline's schedule, the reduction, the update), left at its peak: gradients still held, the optimizer state
    created. Returns the strategy, the most device bytes its setup held at once, and the bytes the step's
    collectives and transfers carried by kind. Without a batch the backward is a synthetic one that touches every
    parameter (model state as in a run; the bytes then leave out what depends on the data). Host memory is on the
    meta device too; on ``device_type`` "cuda" it is laid out as apart from the device's."""
    model = meta_copy(module)
    strategy = get_strategy(name, **options)
    env = Environment(device=META, rank=rank, local_rank=rank, world_size=world_size, host=META,
                      separate_host=device_type == "cuda")
    strategy.setup_environment(env, comm=PlanComm(world_size, rank, META))
    with LiveBytes(META) as setup:
        strategy.setup(model, _optimizer(model), precision)
    comms = strategy.comms()
    for comm in comms:
        comm.stats.reset()
    if strategy.optimizer is not None:
        model.train()
        _one_step(strategy, model, module, batch, precision, trace_on, crossing)
    moved: dict[str, int] = {}
    for comm in comms:
        for kind, n in comm.stats.bytes.items():
            moved[kind] = moved.get(kind, 0) + n
    return strategy, setup.peak, moved


def _one_step(strategy: Any, model: nn.Module, module: nn.Module, batch: Any, precision: Precision,
              trace_on: str, crossing: dict | None) -> None:
    meta_batch = None if batch is None else \
        precision.convert_input(apply_to_collection(batch, torch.Tensor, lambda t: t.to(META)))
    if isinstance(strategy, RunsSchedule) and meta_batch is not None:
        if crossing is None:
            crossing = _crossing(strategy, module, batch, precision, trace_on)
        strategy.expect(crossing)
        strategy.run_schedule(model, meta_batch, 1.0)
    elif meta_batch is not None and not isinstance(strategy, RunsSchedule):
        with strategy.forward_context():
            loss, _ = unpack_output(model.training_step(meta_batch, 0))
        if loss is not None:
            strategy.backward(loss)
    else:  # no data: a backward that reaches every trainable parameter this rank runs
        params = [p for p in (strategy.inner.module if isinstance(strategy, RunsSchedule) else model).parameters()
                  if p.requires_grad]
        if params:
            (strategy.inner if isinstance(strategy, RunsSchedule) else strategy).backward(
                torch.stack([p.sum() for p in params]).sum() * 0)
    strategy.reduce_gradients(1.0)
    strategy.optimizer_step()  # its collectives counted, its state created; gradients are still held


def _crossing(strategy: Any, module: nn.Module, batch: Any, precision: Precision, trace_on: str) -> dict:
    """What crosses a planned pipeline's boundaries, traced with fake tensors where autocast runs as in the run (the
    dtype of an activation crossing a boundary is the forward's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    full = meta_copy(module)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        full.to_empty(device=trace_on)
        fake = precision.convert_input(
            apply_to_collection(batch, torch.Tensor, lambda t: mode.from_tensor(t.to(trace_on))))
        with torch.no_grad(), precision.forward_context(torch.device(trace_on)):
            return strategy.crossing(full, fake)


def estimate(module: nn.Module, batch: Any, world_size: int = 1, precision: str = "32",
             strategies: Sequence[str] = STRATEGIES, device_memory: str | int | None = None,
             activation_checkpointing: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None = None,
             device_type: str = "cpu") -> Estimate:
    """Plan ``module`` (built on the meta device: ``with torch.device("meta"): module = MyModule()``; a real
    module is copied there) on ``world_size`` ranks, one row per strategy.

    Args:
        batch: one micro-batch as a rank sees it (any device; only its shapes and dtypes matter), or None: the
            model-state columns only (activations and the step's bytes depend on the data).
        precision: the Trainer's precision.
        device_memory: bytes per device ("80GB") to say which plans fit (with 10% headroom).
        activation_checkpointing: the policy for the checkpointed column (default: the repeated blocks).
        device_type: "cpu" or "cuda": the device the run will train on (a GPU's host memory is apart from its own:
            offload's page-locked copies and device scratch); activations are traced with its autocast when it is
            available here, else on the CPU.
    """
    module = meta_copy(module)
    module.configure_model()
    policy = Precision.from_name(precision)
    trace_on = device_type if device_type == "cpu" or torch.cuda.is_available() else "cpu"
    traced: dict[tuple, tuple[int, int]] = {}  # per set of parameter dtypes a strategy computes with
    rows = []
    optimizer = type(_optimizer(meta_copy(module)))
    for name in strategies:
        if name == "pipeline" and not callable(getattr(module, "pipeline_layers", None)):
            rows.append(StrategyEstimate(name, note="n/a: the module has no pipeline_layers()"))
            continue
        if issubclass(optimizer, SelfReducing) and not get_strategy(name).accepts_self_reducing:
            rows.append(StrategyEstimate(name, note=f"n/a: {optimizer.__name__} does not run under {name}"))
            continue
        strategy, setup_peak, moved = _heaviest(name, module, policy, world_size, batch, device_type, trace_on)
        plain = checkpointed = None
        if batch is not None:
            dtypes = {n: p.dtype for n, p in strategy.module.named_parameters()}
            key = tuple(sorted((n, str(d)) for n, d in dtypes.items()))
            if key not in traced:
                traced[key] = _activations(module, batch, policy, trace_on, activation_checkpointing, dtypes)
            plain, checkpointed = traced[key]
        report = strategy.memory_report()
        note = f"{strategy.stages} stages x {strategy.replicas} replicas, layers {strategy.stage_sizes}" \
            if name == "pipeline" else ""
        rows.append(StrategyEstimate(name, report.device_total, report.host_total, plain, checkpointed,
                                     sum(moved.values()) if batch is not None else None, dict(report.device), note,
                                     setup_peak, report.pinned, moved, strategy.rank))
    params = sum(p.numel() for p in module.parameters())
    memory = parse_bytes(device_memory) if device_memory is not None else None
    return Estimate(params, world_size, policy.name, rows, memory)


def _heaviest(name: str, module: nn.Module, precision: Precision, world_size: int, batch: Any,
              device_type: str, trace_on: str) -> tuple[Any, int, dict[str, int]]:
    """The strategy as set up on the rank that holds the most: not rank 0 (uneven shards' padding lands on the
    last ranks), and under pipeline the heaviest stage, with as many stages as the world and the layers allow."""
    if name != "pipeline":
        return _setup(name, module, precision, world_size, 1 if world_size > 1 else 0, batch, device_type, trace_on)
    layers = len(module.pipeline_layers())
    stages = max(d for d in range(1, world_size + 1) if world_size % d == 0 and d <= layers)
    first = _setup(name, module, precision, world_size, 0, None, device_type, trace_on, stages=stages)[0]
    crossing = _crossing(first, module, batch, precision, trace_on) if batch is not None else None  # traced once
    setups = [_setup(name, module, precision, world_size, rank, batch, device_type, trace_on, crossing,
                     stages=stages) for rank in range(stages)]
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


def choose(plan: Estimate, checkpointing: bool) -> StrategyEstimate:
    """What ``strategy="auto"`` takes: the first of ``AUTO_ORDER`` (fastest first) whose model state and one
    micro-batch's activations fit the device memory with headroom; raises, naming the smallest plan, if none does."""
    assert plan.device_memory is not None
    limit = HEADROOM * plan.device_memory

    rows = [row for row in (plan.row(name) for name in AUTO_ORDER) if row.applies]
    for row in rows:
        if row.need(checkpointing) <= limit:
            return row
    smallest = min(rows, key=lambda row: row.need(checkpointing))
    activations = smallest.activations_checkpointed if checkpointing else smallest.activations
    raise ValueError(
        f"No strategy fits in {human(plan.device_memory)} per device ({int(HEADROOM * 100)}% usable): the smallest "
        f"plan is {smallest.strategy} with {human(smallest.need(checkpointing))} per rank (model state "
        f"{human(smallest.device)}, activations {human(activations)}, setup peak {human(smallest.setup)}) at "
        f"{plan.world_size} ranks. Use more devices, activation checkpointing, a smaller batch, or another strategy "
        "by name (zero3, pipeline).")


def device_memory_of(device: torch.device) -> int:
    """The memory one rank may plan on: the GPU's, or on the CPU the machine's divided among its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks)
