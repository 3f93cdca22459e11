"""Plan before you run: per-rank memory and communication of every strategy, without allocating the model.

``estimate()`` builds nothing real. The module's parameters live on the meta device; each strategy is set
up on a copy of it exactly as in training (same buckets, padding, shards, offload placement), at the
rank and world size asked for, with communication skipped, and its ``memory_report()`` (the accounting
the live strategy reports) gives the model-state bytes on the device and on the host; the optimizer's
state is created the way its first step creates it. Activations are the bytes autograd saves for
backward in one micro-batch's ``training_step`` traced on the meta device (``ActivationMeter``), with
and without activation checkpointing. Communication is the payload per optimizer step, per rank, in
``Comm``'s units, read off the strategy's buckets (padding included).
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
from trainkit_strategies import ActivationMeter, Environment, Precision, SelfReducing, get_strategy
from trainkit_strategies.comm import Comm
from trainkit_strategies.fsdp import FSDPStrategy
from trainkit_strategies.memory import LiveBytes

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
    activations: int = 0  # saved for backward, one micro-batch
    activations_checkpointed: int = 0  # the same under activation checkpointing
    comm: int = 0  # payload per optimizer step
    detail: dict[str, int] = field(default_factory=dict)  # device bytes by category
    note: str = ""  # the pipeline's stage split, or why the strategy does not apply
    setup: int = 0  # device bytes at the peak of setup (measured while the strategy builds its buckets or shards)
    pinned: int = 0  # the page-locked part of ``host`` (what crosses the bus)

    @property
    def applies(self) -> bool:
        return not self.note.startswith("n/a")

    def need(self, checkpointed: bool = False) -> int:
        """Device bytes for training: model state plus one micro-batch's activations (checkpointed or not), or the
        setup's peak when that is higher."""
        return max(self.setup, self.device + (self.activations_checkpointed if checkpointed else self.activations))

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
                         f"{human(r.activations):>13}{human(r.activations_checkpointed):>11}{human(r.setup):>12}"
                         f"{human(r.comm):>12}  {fits:<4}  {r.note}")
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


def _init_state(optimizer: Optimizer) -> None:
    """Create the optimizer's state as its first step does, on meta tensors (no arithmetic happens); gradients
    the strategy holds are left as they were."""
    saved, grads = [], {}
    for group in optimizer.param_groups:
        saved.append(group.get("fused"))
        if "fused" in group:
            group["fused"] = False  # no fused kernel for meta tensors; the state it creates is the same
        for p in group["params"]:
            grads[p] = p.grad
            p.grad = torch.empty_like(p) if p.grad is None else p.grad
    optimizer.step()
    for group, fused in zip(optimizer.param_groups, saved, strict=True):
        if fused is not None:
            group["fused"] = fused
        for p in group["params"]:
            p.grad = grads[p]


def _comm_bytes(strategy: Any) -> int:
    """Payload per optimizer step and rank, by the strategy's buckets (``Comm``'s conventions)."""
    if strategy.world_size == 1:
        return 0
    name = strategy.name
    if name == "ddp":
        return sum(b.buffer.numel() * b.buffer.element_size() for b in strategy._buckets)
    if name in ("zero1", "zero2", "zero_offload"):
        size = strategy.precision.working_dtype.itemsize
        return 2 * sum(b.padded for b in strategy.buckets) * size
    if name in ("zero3", "fsdp"):
        size = strategy.precision.working_dtype.itemsize
        reduced = sum(b.layout.padded for b in strategy.buckets) * strategy.grad_dtype.itemsize
        return 2 * sum(b.layout.padded for b in strategy.buckets) * size + reduced
    if name == "pipeline":
        return _comm_bytes(strategy.inner)
    return 0


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
           device_type: str = "cpu", **options: Any) -> tuple[Any, int]:
    """``name`` set up on a meta copy of ``module`` as rank ``rank`` of ``world_size``, after one backward on the
    meta device (buffers a strategy allocates on first use exist then, as in a run) and with the optimizer state
    its first step creates; and the most device bytes its setup held at once. Host memory is on the meta device too;
    on ``device_type`` "cuda" it is laid out as apart from the device's (offload's device scratch and page-locked
    copies)."""
    model = meta_copy(module)
    strategy = get_strategy(name, **options)
    env = Environment(device=META, rank=rank, local_rank=rank, world_size=world_size, host=META,
                      separate_host=device_type == "cuda")
    strategy.setup_environment(env, comm=Comm(device=META))  # the layouts of world_size ranks, no communication
    with LiveBytes(META) as setup:
        strategy.setup(model, _optimizer(model), precision)
    if name != "pipeline":  # its schedule exchanges activations, which a meta rank has nobody to send to
        model.train()
        loss, _ = unpack_output(model.training_step(apply_to_collection(batch, torch.Tensor, lambda t: t.to(META)), 0))
        if loss is not None:
            strategy.backward(loss)
            strategy.reduce_gradients(1.0)
    if strategy.optimizer is not None:
        _init_state(strategy.optimizer)
    return strategy, setup.peak


def estimate(module: nn.Module, batch: Any, world_size: int = 1, precision: str = "32",
             strategies: Sequence[str] = STRATEGIES, device_memory: str | int | None = None,
             activation_checkpointing: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None = None,
             device_type: str = "cpu") -> Estimate:
    """Plan ``module`` (built on the meta device: ``with torch.device("meta"): module = MyModule()``; a real
    module is copied there) on ``world_size`` ranks, one row per strategy.

    Args:
        batch: one micro-batch as a rank sees it (any device; only its shapes and dtypes matter).
        precision: the Trainer's precision.
        device_memory: bytes per device ("80GB") to say which plans fit (with 10% headroom).
        activation_checkpointing: the policy for the checkpointed column (default: the repeated blocks).
        device_type: "cpu" or "cuda": where autocast is traced for the activation columns.
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
        strategy, setup_peak = _heaviest(name, module, policy, world_size, batch, device_type)
        dtypes = {n: p.dtype for n, p in strategy.module.named_parameters()}
        key = tuple(sorted((n, str(d)) for n, d in dtypes.items()))
        if key not in traced:
            traced[key] = _activations(module, batch, policy, trace_on, activation_checkpointing, dtypes)
        plain, checkpointed = traced[key]
        report = strategy.memory_report()
        note = f"{strategy.stages} stages x {strategy.replicas} replicas, layers {strategy.stage_sizes}" \
            if name == "pipeline" else ""
        rows.append(StrategyEstimate(name, report.device_total, report.host_total, plain, checkpointed,
                                     _comm_bytes(strategy), dict(report.device), note, setup_peak, report.pinned))
    params = sum(p.numel() for p in module.parameters())
    memory = parse_bytes(device_memory) if device_memory is not None else None
    return Estimate(params, world_size, policy.name, rows, memory)


def _heaviest(name: str, module: nn.Module, precision: Precision, world_size: int, batch: Any,
              device_type: str) -> tuple[Any, int]:
    """The strategy as set up on the rank that holds the most: not rank 0 (uneven shards' padding lands on the
    last ranks), and under pipeline the heaviest stage, with as many stages as the world and the layers allow."""
    if name != "pipeline":
        return _setup(name, module, precision, world_size, 1 if world_size > 1 else 0, batch, device_type)
    layers = len(module.pipeline_layers())
    stages = max(d for d in range(1, world_size + 1) if world_size % d == 0 and d <= layers)
    setups = [_setup(name, module, precision, world_size, rank, batch, device_type, stages=stages)
              for rank in range(stages)]
    return max(setups, key=lambda s: s[0].memory_report().device_total)


def one_batch(module: nn.Module, data: Any = None) -> Any:
    """The first training batch of ``data`` (a DataModule) or of the module's own ``train_dataloader``."""
    source = data if data is not None else module
    if data is not None:
        data.setup("fit")
    loader = source.train_dataloader()
    if loader is None:
        raise ValueError("estimate needs one training batch to trace: pass --data, or implement train_dataloader() "
                         "on the module.")
    return first_batch(loader)


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
