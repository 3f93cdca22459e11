"""One strategy rehearsed on meta tensors as one rank of a run would take it: set up on a meta copy of the module
(its setup's peak measured by ``SetupMeter``), then one optimizer step, with a ``PlanComm`` that counts every byte and
moves none. ``trainkit estimate`` (``estimate.py``) reads its rows from what these leave behind."""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from trainkit.manual import strategy_optimizer
from trainkit.module import TrainModule
from trainkit.optim import parse_optimizers
from trainkit.step import unpack_output
from trainkit_strategies import Environment, Parallelizes, Precision, RunsSchedule, Strategy, capability
from trainkit_strategies.communication.plan_comm import PlanComm
from trainkit_strategies.context.huggingface import without_masks
from trainkit_strategies.planning.setup import SetupMeter, SetupPeak

META = torch.device("meta")


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


def plan_optimizer(module: nn.Module) -> Optimizer:
    """The module's optimizer, as ``fit`` would make it, over its meta parameters."""
    try:
        return strategy_optimizer(parse_optimizers(module.configure_optimizers()))
    except Exception:  # configure_optimizers may need a Trainer; plan with plain AdamW then
        return torch.optim.AdamW(module.parameters())

def to_fake(model: nn.Module, device: str, dtypes: dict[str, torch.dtype] | None) -> None:
    """``model``'s meta parameters and buffers replaced by fake tensors on ``device`` (under a ``FakeTensorMode``),
    each parameter in the dtype ``dtypes`` gives it. Made from their shapes, not by ``to_empty``: a fake mode first
    converts a meta tensor passed to an operation into a fake one, which was a third of a trace's time."""
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    for name, p in model.named_parameters():
        if dtypes and name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])


def set_up(strategy: Strategy, module: nn.Module, precision: Precision, world_size: int, rank: int,
           device_type: str = "cpu", devices_per_node: int | None = None) -> tuple[Any, nn.Module, SetupPeak]:
    """``strategy`` (a fresh copy of the planned one) set up on a meta copy of ``module`` as rank ``rank`` of
    ``world_size`` with a ``PlanComm`` (every byte counted, none moved). Returns the strategy, its model and its
    setup's peak (``SetupMeter``: what the rank keeps of the model as built, what the setup allocates at once, the
    largest whole tensor it rebuilds). Host memory is on the meta device too; on ``device_type`` "cuda" it is laid out
    as apart from the device's."""
    model = meta_copy(module)
    strategy = copy.deepcopy(strategy)
    separate = device_type == "cuda"
    env = Environment(device=META, rank=rank, local_rank=rank, world_size=world_size, host=META,
                      separate_host=separate, local_world_size=devices_per_node or 0)
    strategy.setup_environment(env, comm=PlanComm(world_size, rank, META))
    parallelizes = capability(strategy, Parallelizes)
    if parallelizes is not None:  # the axes cut the meta model first, as a run's transforms do: nothing allocated
        parallelizes.parallelize(model)
    optimizer = plan_optimizer(model)
    with SetupMeter(model, META, separate) as meter:
        strategy.setup(model, optimizer, precision)
    peak = meter.peak(strategy.memory_report())
    without_masks(model)  # Hugging Face models: no mask made (its code reads values a meta tensor has none of)
    return strategy, model, peak


def step(strategy: Any, model: nn.Module, module: nn.Module, batch: Any, precision: Precision, trace_on: str,
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
            crossing = crossing_of(strategy, module, batch, precision, trace_on)
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


def crossing_of(strategy: Any, module: nn.Module, batch: Any, precision: Precision, trace_on: str,
              dtypes: dict[str, torch.dtype] | None = None) -> dict:
    """What crosses a planned pipeline's boundaries, traced with fake tensors where autocast runs as in the run, with
    the parameters in the dtypes the stages compute with (the dtype of an activation crossing a boundary is the
    forward's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    full = strategy.activation_model(meta_copy(module), torch.device(trace_on))  # as a rank computes it
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        to_fake(full, trace_on, dtypes)  # in the dtypes the stages compute with
        fake = precision.convert_input(
            apply_to_collection(batch, torch.Tensor, lambda t: mode.from_tensor(t.to(trace_on))))
        with torch.no_grad(), precision.forward_context(torch.device(trace_on)):
            return capability(strategy, RunsSchedule).crossing(full, fake)


def heaviest(strategy: Strategy, module: nn.Module, precision: Precision, world_size: int, batch: Any,
             device_type: str, trace_on: str,
             devices_per_node: int | None = None) -> tuple[Any, SetupPeak, dict[str, dict[str, int]]]:
    """The strategy as set up on the rank that holds the most, of the ranks it says differ (``planned``). A schedule
    is planned with what crosses its boundaries, traced once, after every stage is set up (each converts its own
    parameters to the dtypes it computes with) and before any steps."""
    planned, ranks = strategy.planned(module, world_size)
    built = [set_up(planned, module, precision, world_size, r, device_type, devices_per_node) for r in ranks]
    crossing = None
    if capability(planned, RunsSchedule) is not None and batch is not None:  # stages' parameters in compute dtypes
        initial = {n: p.dtype for n, p in module.named_parameters()}
        dtypes = dict(initial)
        for stage, _, _ in built:  # a stage converts its own parameters only
            dtypes |= {n: p.dtype for n, p in stage.module.named_parameters() if p.dtype != initial.get(n, p.dtype)}
        crossing = crossing_of(built[0][0], module, batch, precision, trace_on, dtypes)
    setups = [(s, peak, step(s, model, module, batch, precision, trace_on, crossing)) for s, model, peak in built]
    return max(setups, key=lambda s: s[0].memory_report().device_total)
