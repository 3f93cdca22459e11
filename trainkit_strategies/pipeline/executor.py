"""Pipeline parallelism: layers split across ranks, micro-batches streamed through them by a schedule.

A module opts in by exposing ``pipeline_layers()`` (an ordered sequence of modules whose composition is
its forward) and ``pipeline_loss(output, batch)`` (the loss on the last stage's output; a mean over its
items, optionally ``{"loss", "num_items"}``). Optional: ``pipeline_input(batch)`` (default: the batch's
first element) and ``pipeline_validation_step(output, batch, batch_idx) -> {name: mean}`` for
evaluation. The layers are split into contiguous stages balanced by parameter count (or ``split``);
with ``world_size = stages * replicas`` rank ``r`` runs stage ``r // replicas`` of replica
``r % replicas`` (``layout.py``: stages outermost), and each stage's gradients are reduced across
replicas by the layout's data-parallel engine (ddp, zero1, zero2 or fsdp) working in that stage's
subgroup: ``Pipeline`` is a part of the composed strategy (``parallel/strategy.py``; ``pipeline`` is its preset), not a
strategy around another. With ``virtual_stages = v`` the layers are cut into
``stages * v`` chunks and rank ``s`` holds chunks ``s, s + stages, s + 2 stages, ...`` (interleaved 1F1B).

One batch is cut into ``microbatches`` pieces and run by a schedule from ``schedules.py`` (1F1B by
default): activations and their gradients travel between neighbouring chunks with asynchronous
send/recv, one communicator per chunk boundary and direction (NCCL matches point-to-point operations by
the order each end issues them; with one direction per communicator both ends issue theirs in micro-batch
order whatever the schedule), each preceded the first time by a small header (shape and dtype, on a host
group) so stages need not know shapes in advance. Under ``zero_bubble`` a backward is split into B (the input
gradient, ``split_backward.input_gradient``) and W (the weight gradients), which the schedule runs later.
Every micro-batch's loss is weighted by its item count (samples unless ``num_items`` is given), so the
pipelined step equals the full-batch step. Parameters shared by layers on different stages (a tied
embedding and LM head) are kept in sync by summing their gradients across those stages each step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from trainkit_strategies.base import Strategy
from trainkit_strategies.capabilities import RunsSchedule
from trainkit_strategies.communication.comm import Comm, Handle
from trainkit_strategies.communication.layout import AXES, Mesh
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.experts.auxiliary import attached, collecting, with_auxiliary
from trainkit_strategies.init.materialise import replace_parameter
from trainkit_strategies.pipeline.channels import Channel, links
from trainkit_strategies.pipeline.microbatches import (
    first_tensor,
    loss_items,
    missing_hooks,
    model_input,
    signature,
    split_batch,
)
from trainkit_strategies.pipeline.schedules import SCHEDULES, rank_and_chunk, schedule_for, virtual_stage
from trainkit_strategies.pipeline.split_backward import WeightGradients, input_gradient
from trainkit_strategies.pipeline.stages import Chunks, cut, owners
from trainkit_strategies.planning.memory import ActivationMeter
from trainkit_strategies.registry import strategy_class
from trainkit_strategies.state import pieces as st

DATA_PARALLEL = ("ddp", "zero1", "zero2", "fsdp")
STAGE_AXES = tuple(a for a in AXES if a != "pp")  # the ranks running one stage


def check_schedule(schedule: str, data_parallel: str) -> None:
    """Fail, naming the fix, where ``schedule`` cannot run with the ``data_parallel`` engine in each stage."""
    if schedule == "zero_bubble" and not strategy_class(data_parallel).splits_backward:
        raise ConfigurationError(
            f"pipeline schedule 'zero_bubble' computes weight gradients in a second autograd pass, "
            f"after {data_parallel} has freed the gathered parameters and reduced the first; use "
            f"data_parallel 'ddp', 'zero1' or 'zero2' with it, or schedule '1f1b' or "
            f"'interleaved_1f1b' with {data_parallel}.")


class Pipeline(RunsSchedule):
    """The pipeline axis of a composed strategy (``ParallelStrategy`` with ``pp`` stages): the stages cut from the
    model, the links between them and the schedule that runs a batch through them. The data-parallel engine of the
    stage's ranks (its one nested strategy) holds the chunks' parameters; this part calls it for the stage's
    forward, backward and no-sync windows.

    Args:
        microbatches: pieces each batch is cut into along its first dimension (``tensor_split``: sizes
            differ by at most one); a batch with fewer samples runs with one micro-batch per sample.
        schedule: "1f1b" (bounded activation memory), "gpipe", "interleaved_1f1b" (with ``virtual_stages``;
            ``microbatches`` a multiple of ``stages``) or "zero_bubble" (ZB-H1: B and W split).
        virtual_stages: model chunks per rank under "interleaved_1f1b" (or "gpipe").
        split: layers per chunk (``stages * virtual_stages`` of them), e.g. ``[3, 5]``; default: balanced by
            parameter count.
        measure_activations: record the peak of activation bytes alive per step (``activation_peak``).
    """

    def __init__(self, microbatches: int = 4, schedule: str = "1f1b", virtual_stages: int = 1,
                 split: list[int] | None = None, measure_activations: bool = False) -> None:
        if microbatches < 1:
            raise ConfigurationError(f"pipeline microbatches must be >= 1; got {microbatches}.")
        if schedule not in SCHEDULES:
            raise ConfigurationError(f"pipeline schedule must be one of {sorted(SCHEDULES)}; got {schedule!r}.")
        if virtual_stages < 1 or (virtual_stages > 1 and schedule not in ("interleaved_1f1b", "gpipe")):
            raise ConfigurationError(
                f"pipeline virtual_stages={virtual_stages}: several model chunks per rank run under "
                f"schedule 'interleaved_1f1b' (or 'gpipe'), not {schedule!r}; use virtual_stages=1.")
        self.microbatches, self.schedule, self.virtual_stages = microbatches, schedule, virtual_stages
        self.split, self.measure_activations = split, measure_activations
        self.stages = 1
        self.stage_sizes: list[int] = []
        self.activation_peak = {"micro_batches": 0, "bytes": 0}
        self.idle = {"wait_s": 0.0, "schedule_s": 0.0}  # the last schedule's time blocked on peers, and its length
        self._tied: list[tuple[nn.Parameter, Comm, bool]] = []  # (param, comm of its stages, counted in norms)
        self._to_global: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._actions: dict[int, list] = {}  # micro-batch count -> this stage's schedule

    # -- topology ------------------------------------------------------------------------------------
    def connect(self, comm: Comm, mesh: Mesh, device: torch.device) -> None:
        """This rank's stage of ``mesh`` (whose ``pp`` axis is the stages) and the links to its neighbours, over
        ``comm`` (the mesh's world). Collective: every rank makes every group, in one order."""
        stages, v = mesh.layout.pp, self.virtual_stages
        if v > 1 and stages < 2:
            raise ConfigurationError(
                f"pipeline virtual_stages={v} interleaves chunks across ranks; it needs stages >= 2.")
        if self.schedule == "interleaved_1f1b" and self.microbatches % stages:
            raise ConfigurationError(
                f"pipeline schedule 'interleaved_1f1b' runs micro-batches in groups of stages={stages}: "
                f"set microbatches to a multiple of {stages} (got {self.microbatches}).")
        self.comm, self.device, self.stages = comm, device, stages
        self.stage = mesh.coords["pp"]
        self.pipe = mesh.comm("pp")
        self.on_stage = mesh.comm(STAGE_AXES)  # the ranks running this stage: they share its gradients
        # one pipeline per coordinate of the other axes, its ranks in stage order; every rank makes every group
        self._lines = [[comm.ranks[r] for r in line] for line in mesh.layout.groups(("pp",))]
        self._line = next(i for i, line in enumerate(self._lines) if comm.ranks[comm.rank] in line)
        self.headers, self.links = links(comm, self._lines, self._line, stages * v, stages)

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    # -- setup ---------------------------------------------------------------------------------------
    def cut(self, module: nn.Module, optimizer: Optimizer | None, engine: Strategy,
            shape: Callable[[Tensor], tuple[int, ...]], shapes: dict[str, tuple[int, ...]]) -> nn.Module:
        """This rank's chunks of ``module``'s ``pipeline_layers()`` (the layers of other stages emptied, the
        optimizer's groups cut to this stage's parameters, parameters tied across stages kept apart in ``engine``),
        for ``engine`` to set up. ``shape``: a parameter's whole shape; ``shapes``: every tensor's, by name."""
        missing = missing_hooks(module)
        if missing:
            raise TypeError(
                f"Strategy 'pipeline' needs {type(module).__name__} to define {' and '.join(missing)}: "
                "pipeline_layers() -> the ordered layers whose composition is the model, and "
                "pipeline_loss(output, batch) -> the loss on the last layer's output. See docs/pipeline.md."
            )
        self.engine = engine
        layers = list(module.pipeline_layers())
        names = st.param_names(module)
        self._shapes = shapes | {n: shape(q) for q, n in names.items()}
        p, v = self.stages, self.virtual_stages
        counts = cut([sum(math.prod(shape(q)) for q in layer.parameters()) for layer in layers], p, v, self.split)
        self.stage_sizes = counts  # layers per chunk, in model order (per stage when virtual_stages is 1)
        bounds = [sum(counts[:k]) for k in range(p * v + 1)]
        rank_of = owners(layers, bounds, p, names)  # the pipeline ranks holding each parameter
        mine = [q for q, ranks in rank_of.items() if self.stage in ranks]
        self._tied = []
        for q in names:  # every rank creates every group, in one order
            holders = sorted(rank_of.get(q, ()))
            if len(holders) < 2:
                continue
            groups = [self.comm.subgroup([line[s] for s in holders]) for line in self._lines]
            if self.stage in holders:
                self._tied.append((q, groups[self._line], self.stage == holders[0]))
        with torch.no_grad():
            for q in names:
                if q not in rank_of or self.stage not in rank_of[q]:  # another stage's: never run here
                    if q.is_meta:  # built on meta: never materialised whole here
                        replace_parameter(q, torch.empty(0, dtype=q.dtype, device=self.device))
                    else:
                        q.data = torch.empty(0, dtype=q.dtype, device=q.device)
            for q, group, _ in self._tied:  # start equal: the first stage holding it decides (through the device)
                if group.active and not q.is_meta:  # on meta, every stage will get the one-process value
                    on_device = q.data.to(self.device)
                    group.broadcast(on_device, src=0)
                    q.data.copy_(on_device)
        for q, _, _ in self._tied:  # its gradient is summed across stages and counted in norms once
            engine.keep_apart([q])
        ks = [virtual_stage(self.stage, c, p) for c in range(v)]
        self._stage = Chunks([layers[bounds[k] : bounds[k + 1]] for k in ks])
        self._virtual = ks  # chunk c is virtual stage ks[c]
        buffer_names = {id(b): n for n, b in st.persistent_buffers(module)}
        self._to_global = {n: names[q] for n, q in self._stage.named_parameters()}
        self._to_global |= {n: buffer_names[id(b)] for n, b in st.persistent_buffers(self._stage)}
        if optimizer is not None:
            kept = set(mine)
            for group in optimizer.param_groups:
                group["params"] = [q for q in group["params"] if q in kept]
        return self._stage

    def open_channels(self) -> None:
        """The chunks' channels, once the engine has set them up."""
        p, v, ks = self.stages, self.virtual_stages, self._virtual
        self._actions = {}
        self._params = [[q for q in chunk.parameters() if q.requires_grad] for chunk in self._stage.chunks]
        # per chunk: activations in from the previous chunk and their gradients back to it; out to the next
        # chunk and its gradients back from it, each on its boundary's link of that direction (peer: the other end
        # of the pair), shape headers on the host group (peer: that end's stage), tagged by boundary and direction
        last = p * v - 1

        def channel(k: int, direction: str, peer: int) -> Channel:
            tag = 2 * k + (1 if direction == "F" else 2)
            return Channel(self.links[(k, direction)], peer, self.device, self.headers,
                           rank_and_chunk(k + peer, p)[0], tag)

        self._recv_f = [channel(k - 1, "F", 0) if k else None for k in ks]
        self._send_b = [channel(k - 1, "B", 0) if k else None for k in ks]
        self._send_f = [channel(k, "F", 1) if k < last else None for k in ks]
        self._recv_b = [channel(k, "B", 1) if k < last else None for k in ks]

    def crossing(self, module: nn.Module, batch: Any) -> dict[int, dict[tuple, tuple[tuple[int, ...], torch.dtype]]]:
        """The shape and dtype of what crosses each chunk boundary for each micro-batch signature of ``batch``, found
        by running ``module`` (a whole copy of the model, on any device: fake tensors, say) through its layers as the
        chunks split them; for ``expect``."""
        layers = list(module.pipeline_layers())
        bounds = [sum(self.stage_sizes[:k]) for k in range(len(self.stage_sizes) + 1)]
        crossing: dict[int, dict[tuple, tuple[tuple[int, ...], torch.dtype]]] = {}
        for chunk in self._chunks(batch):
            x = model_input(module, chunk)
            for k in range(len(bounds) - 2):
                for layer in layers[bounds[k] : bounds[k + 1]]:
                    x = layer(x)
                crossing.setdefault(k, {})[signature(chunk)] = (tuple(x.shape), x.dtype)
        return crossing

    def expect(self, crossing: dict[int, dict[tuple, tuple[tuple[int, ...], torch.dtype]]]) -> None:
        """Tell this rank's channels what crosses their boundaries (``crossing``), as the first step's shape headers
        would: for a rank planned alone (``trainkit estimate``), which no peer sends headers to."""
        for c, k in enumerate(self._virtual):
            for channel, boundary in ((self._recv_f[c], k - 1), (self._send_b[c], k - 1), (self._send_f[c], k),
                                      (self._recv_b[c], k)):
                if channel is not None:
                    channel.shapes.update(crossing[boundary])

    # -- the schedule --------------------------------------------------------------------------------
    def _chunks(self, batch: Any) -> list[Any]:
        """The batch in ``microbatches`` pieces (fewer for a batch with fewer samples, e.g. an epoch's last)."""
        return split_batch(batch, min(self.microbatches, first_tensor(batch).shape[0]))

    def _schedule_for(self, microbatches: int) -> list:
        if microbatches not in self._actions:
            schedule = schedule_for(self.schedule, self.stages, microbatches, self.virtual_stages)
            self._actions[microbatches] = schedule[self.stage]
        return self._actions[microbatches]

    def run_schedule(self, module: nn.Module, batch: Any, weight: float) -> tuple[Tensor, Tensor | float]:
        chunks = self._chunks(batch)
        keys = [signature(c) for c in chunks]
        actions = self._schedule_for(len(chunks))
        last_k = self.stages * self.virtual_stages - 1
        # the batch's mean loss, for progress bars and loggers on every stage: the last stage has it after its last
        # forward; it is broadcast once the stage-to-stage traffic is done (a collective crossing point-to-point
        # operations in flight on other communicators can deadlock on NCCL)
        mean = torch.zeros(1, device=self.device)
        arrivals: dict[int, list[int]] = {}  # per chunk, the micro-batches whose input arrives, in order
        for a in actions:
            if a.kind == "RECV_F":
                arrivals.setdefault(a.chunk, []).append(a.microbatch)
        for c, order in arrivals.items():  # receives posted ahead: the first now, each next one on arrival
            self._recv_f[c].post(keys[order[0]], order[0])  # type: ignore[union-attr]
        inputs: dict[tuple[int, int], Tensor] = {}  # keyed by (micro-batch, chunk)
        outputs: dict[tuple[int, int], Tensor] = {}
        grads: dict[tuple[int, int], Tensor] = {}
        input_grads: dict[tuple[int, int], Tensor | None] = {}
        weights: dict[tuple[int, int], WeightGradients] = {}
        held: dict[tuple[int, int], int] = {}
        split = self.schedule == "zero_bubble"
        sends: list[Handle] = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        items: Tensor | float = 0.0
        live = peak = peak_bytes = live_bytes = 0
        started, waited = time.perf_counter(), 0.0
        with self.engine.no_sync():
            for a in actions:
                kind, mb, c = a.kind, a.microbatch, a.chunk
                key, k = (mb, c), self._virtual[c]
                if kind.startswith("RECV"):
                    before = time.perf_counter()
                if kind == "RECV_F":
                    inputs[key] = self._recv_f[c].recv(keys[mb], mb).requires_grad_(True)  # type: ignore[union-attr]
                    waited += time.perf_counter() - before
                    order = arrivals[c]
                    at = order.index(mb)
                    if at + 1 < len(order):
                        self._recv_f[c].post(keys[order[at + 1]], order[at + 1])  # type: ignore[union-attr]
                elif kind == "F":
                    x = inputs[key] if k else model_input(module, chunks[mb])
                    batch_tensors = [t for t in tree_leaves(chunks[mb]) if isinstance(t, Tensor)]  # no activations:
                    meter = ActivationMeter([*self._stage.parameters(), *batch_tensors]) \
                        if self.measure_activations else None  # the batch is alive for the step under any schedule
                    with self.engine.forward_context(), collecting(self._stage.chunks[c]) as auxiliary, \
                            meter or contextlib.nullcontext():
                        out = self._stage.chunks[c](x)
                        if k == last_k:
                            loss, n = loss_items(module.pipeline_loss(out, chunks[mb]), chunks[mb])
                            loss_sum += loss.detach().double() * n
                            items = items + n
                            out = with_auxiliary(loss, auxiliary) * (n * weight)
                            if mb == len(chunks) - 1:
                                count = items.clamp(min=1) if isinstance(items, Tensor) else max(items, 1.0)
                                mean.copy_((loss_sum / count).float().reshape(1))
                        else:  # the layers' auxiliary terms ride on the output's gradient
                            out = attached(out, auxiliary, weight)
                    outputs[key] = out
                    held[key] = meter.bytes if meter else 0
                    live, live_bytes = live + 1, live_bytes + held[key]
                    peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
                elif kind == "SEND_F":
                    sends += self._send_f[c].send(outputs[key], keys[mb])  # type: ignore[union-attr]
                elif kind == "RECV_B":
                    grads[key] = self._recv_b[c].recv(keys[mb], mb)  # type: ignore[union-attr]
                    waited += time.perf_counter() - before
                elif kind == "B":
                    out, grad = outputs.pop(key), grads.pop(key, None)
                    if split and k:  # the input's gradient now, the weights' at W
                        input_grads[key], weights[key] = input_gradient(out, grad, inputs.pop(key), self._params[c])
                        continue
                    self.engine.backward(out, grad)
                    if k:
                        input_grads[key] = inputs.pop(key).grad
                    live, live_bytes = live - 1, live_bytes - held.pop(key)
                elif kind == "SEND_B":
                    grad = input_grads.pop(key)
                    if grad is None:  # the chunk's output does not depend on its input
                        shape, dtype = self._recv_f[c].shapes[keys[mb]]  # type: ignore[union-attr]
                        grad = torch.zeros(shape, dtype=dtype, device=self.device)
                    sends += self._send_b[c].send(grad, keys[mb])  # type: ignore[union-attr]
                elif kind == "W":
                    pending = weights.pop(key, None)
                    if pending is not None:  # else B ran the whole backward (the first chunk: no input gradient)
                        with self.engine.backward_pass():
                            pending.run()
                        live, live_bytes = live - 1, live_bytes - held.pop(key)
        before = time.perf_counter()
        for handle in sends:
            handle.wait()
        self.activation_peak = {"micro_batches": peak, "bytes": peak_bytes}
        self.pipe.broadcast(mean, src=self.stages - 1)
        now = time.perf_counter()
        self.idle = {"wait_s": waited + now - before, "schedule_s": now - started}
        return mean[0], items

    def evaluates(self, module: nn.Module, has_validation_step: bool) -> bool:
        """``pipeline_validation_step`` alone asks for validation; ``validation_step`` evaluates by
        ``pipeline_loss``."""
        return has_validation_step or callable(getattr(module, "pipeline_validation_step", None))

    def eval_schedule(self, module: nn.Module, batch: Any, batch_idx: int, fn: str = "validate") -> dict[str, Tensor]:
        """Metrics of one evaluation batch, identical on every rank of the pipeline: the means of what
        ``pipeline_validation_step`` returns (weighted by samples) or, without it, ``pipeline_loss`` as
        ``val_loss`` / ``test_loss`` (weighted by its items)."""
        step = getattr(module, "pipeline_validation_step", None)
        loss_name = "test_loss" if fn == "test" else "val_loss"
        chunks = self._chunks(batch)
        last_k = self.stages * self.virtual_stages - 1
        totals: dict[str, tuple[Tensor, float]] = {}
        sends: list[Handle] = []
        with torch.no_grad(), self.engine.forward_context():
            for c, k in enumerate(self._virtual):  # every micro-batch through chunk 0, then chunk 1, ...
                for mb, chunk in enumerate(chunks):
                    key = ("eval", signature(chunk))
                    x = self._recv_f[c].recv(key, -1) if k else model_input(module, chunk)  # type: ignore[union-attr]
                    out = self._stage.chunks[c](x)
                    if k < last_k:
                        sends += self._send_f[c].send(out, key)  # type: ignore[union-attr]
                        continue
                    if callable(step):
                        n = first_tensor(chunk).shape[0]
                        metrics = step(out, chunk, batch_idx * self.microbatches + mb)
                    else:
                        loss, n = loss_items(module.pipeline_loss(out, chunk), chunk)
                        metrics = {loss_name: loss}
                    for name, value in metrics.items():
                        total, weight = totals.get(name, (torch.zeros((), dtype=torch.float64, device="cpu"), 0.0))
                        value = torch.as_tensor(value, dtype=torch.float64, device="cpu").detach()
                        totals[name] = (total + value * float(n), weight + float(n))
        for handle in sends:
            handle.wait()
        result = {k: total / max(weight, 1.0) for k, (total, weight) in totals.items()} if self.last else None
        return self.pipe.broadcast_object(result, src=self.stages - 1)

    # -- what the composing strategy asks of its pipeline axis -----------------------------------------
    def reduce_tied(self) -> None:
        """A shared parameter's gradient is the sum over its stages' uses."""
        for p, comm, _ in self._tied:
            for grad in self.engine.gradients_of([p]):
                comm.all_reduce(grad)

    def counted_elsewhere(self) -> list[Tensor]:
        """Parameters tied across stages that another stage counts in norms."""
        return [p for p, _, counted in self._tied if not counted]

    def own_comms(self) -> list[Comm]:
        return [self.pipe, self.headers, *self.links.values(), *(c for _, c, _ in self._tied)]

    def renamed(self, layout: st.StateLayout, group_names: list[list[str]]) -> st.StateLayout:
        """The stage's holders under the module's names; a parameter tied across stages is written by its first."""
        names = st.param_names(self._stage)
        elsewhere = {self._to_global[names[p]] for p, _, counted in self._tied if not counted}
        return st.renamed_layout(layout, self._to_global.__getitem__, self._shapes, group_names, elsewhere)

    def gathered(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Whole-model tensors on every rank from each stage's (collective over the world); the stage's first rank
        gives its stage's."""
        mine = {self._to_global[n]: t.detach().cpu() for n, t in tensors.items()} if self.on_stage.rank == 0 else {}
        out: dict[str, Tensor] = {}
        for part in self.comm.all_gather_object(mine):
            out |= part
        return out

    def stages_for(self, module: nn.Module, world_size: int) -> int:
        """As many stages as the world and the layers allow (for a pipeline whose depth is left open)."""
        layers = len(module.pipeline_layers())
        return max(d for d in range(1, world_size + 1) if world_size % d == 0 and d <= layers)
