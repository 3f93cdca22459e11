"""Parameter sharding, ZeRO-3 and FSDP style: one engine, two grouping policies.

Every rank stores 1/N of every parameter (ZeRO paper §5.3). Parameters are grouped into *units*; a
unit's parameters are laid out in ``FlatUnit``s (one per optimizer param group it holds), and a
module's parameters are views into the unit's gather buffer, whose storage exists only while the unit
is gathered (``storage.resize_``, as FSDP does; views stay valid objects, so autograd's saved tensors
see the data again when backward re-gathers). The lifecycle of a unit in one step:

1. forward pre-hook: all-gather the unit (waiting for a prefetch if one was issued), and issue the
   next unit's all-gather asynchronously (the order is recorded on the first step);
2. forward hook: free the gathered parameters (``reshard_after_forward``; off keeps them, ZeRO-2-like);
3. backward pre-hook: all-gather again, prefetch the next unit in backward order;
4. when every parameter of the unit has its gradient: copy the gradients into the bucket buffer,
   reduce-scatter into the rank's gradient shard (accumulating across micro-steps), free the unit.

Parameters outside every unit form the *root* unit, gathered from the start of the step's forward to
the end of its backward. Communication per step: Ψ gathered twice and Ψ reduce-scattered (§7: 3Ψ).
Mixed precision follows FSDP's policy: fp32 sharded master, gathers in the compute dtype, gradients
reduced in ``reduce_dtype`` (default: the compute dtype). The optimizer steps the master pieces
(``MasterShards``, shared with ZeRO-1/2, including offload).

Sharded initialisation: inside ``init_context()`` modules are built on the meta device while an
``InitRecorder`` logs what the code computes (``deferred.py``); ``setup`` materialises one unit at a
time, replaying that log for each of its tensors, so every parameter and buffer gets the values a
one-process run gives it (custom ``nn.init`` calls, factories and random draws included), keeps this
rank's pieces and frees the rest: a rank never holds more than its shards plus one unit. Tensors the
log cannot rebuild fall back to their module's ``reset_parameters()``, with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.base import ShardedInit, Strategy
from trainkit_strategies.comm import Handle
from trainkit_strategies.deferred import InitRecorder, Replayer
from trainkit_strategies.flat import BucketReducer, FlatUnit, OrderedLauncher
from trainkit_strategies.master import DeferredGradScale, MasterShards
from trainkit_strategies.memory import MemoryReport
from trainkit_strategies.precision import Precision

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


@dataclass(eq=False)
class Unit:
    """Modules whose parameters are gathered together. The root unit has no modules (the strategy gathers
    it for the whole step); a persistent unit stays gathered."""

    index: int
    modules: list[nn.Module]
    flats: list[FlatUnit] = field(default_factory=list)
    root: bool = False
    persistent: bool = False
    gathered: bool = False
    handles: list[Handle] = field(default_factory=list)
    forward_calls: int = 0
    reduced_flats: int = 0
    pending_grads: int = 0  # gradients still to arrive in this backward (no-sync micro-steps)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ShardedStrategy(DeferredGradScale, Strategy, ShardedInit):
    """The ZeRO-3 / FSDP engine; subclasses choose the units (``unit_modules``) and persistent params.

    Args:
        reshard_after_forward: free gathered parameters after each unit's forward (gather again for
            backward). Off keeps them until the unit's backward: less communication, more memory.
        prefetch: issue the next unit's all-gather while the current one computes.
        offload: keep master weights and optimizer state in host memory (as ZeRO-Offload).
        ratio: with ``offload``, the fraction of the optimizer state kept on the host.
        reduce_dtype: dtype gradients are reduce-scattered and accumulated in ("fp32", "bf16", "fp16");
            default: the compute dtype.
        broadcast_buffers: broadcast rank 0's floating-point buffers (e.g. BatchNorm statistics) after
            every step, as ddp does.
    """

    def __init__(self, reshard_after_forward: bool = True, prefetch: bool = True, offload: bool = False,
                 ratio: float = 1.0, reduce_dtype: str | None = None, broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.broadcast_buffers = broadcast_buffers
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{self.name} ratio must be in [0, 1]; got {ratio}.")
        if reduce_dtype is not None and reduce_dtype not in _DTYPES:
            raise ValueError(f"{self.name} reduce_dtype must be one of {sorted(_DTYPES)}; got {reduce_dtype!r}.")
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.offload, self.ratio, self.reduce_dtype = offload, ratio, reduce_dtype
        self.units: list[Unit] = []
        self._flats: list[FlatUnit] = []
        self._unit_of_flat: dict[int, Unit] = {}
        self._flat_of: dict[Tensor, FlatUnit] = {}
        self._full: dict[int, Tensor] = {}  # flat index -> gather buffer (compute dtype, storage freed when sharded)
        self._shard: dict[int, Tensor] = {}  # flat index -> this rank's piece in the compute dtype
        self._grad: dict[int, Tensor] = {}  # flat index -> gradient shard (reduce dtype)
        self._grad_flats: list[Tensor] = []
        self._launcher = OrderedLauncher([], self._launch)
        self._reducer = BucketReducer(self.comm, torch.float32, torch.device("cpu"), 0)
        self._hooks: list = []
        self.sync_micro_steps = True  # reduce-scatter on micro-steps too (ZeRO-3); fsdp can turn it off
        self._first_micro_step = True
        self._end_queued = False
        self._order: dict[str, list[int]] = {"forward": [], "backward": []}
        self._position = {"forward": 0, "backward": 0}
        self._recorded = {"forward": False, "backward": False}
        self._replaced: dict[Tensor, Tensor] = {}  # meta parameter -> the parameter that replaced it
        self._replayer: Replayer | None = None  # what configure_model computed on the meta device

    # -- policy --------------------------------------------------------------------------------------
    def unit_modules(self, module: nn.Module) -> list[list[nn.Module]]:
        """The modules of each unit, outermost first (a unit may nest inside another)."""
        raise NotImplementedError

    def is_persistent(self, param: Tensor) -> bool:
        """Parameters kept gathered all the time (still sharded for the optimizer)."""
        return False

    # -- setup ---------------------------------------------------------------------------------------
    @property
    def grad_dtype(self) -> torch.dtype:
        return _DTYPES[self.reduce_dtype] if self.reduce_dtype else self.precision.working_dtype

    def init_context(self) -> contextlib.AbstractContextManager:
        return self._recording()

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        recorder = InitRecorder()
        with torch.device("meta"), recorder:
            yield
        self._replayer = Replayer(recorder)

    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        self.module, self.optimizer, self.precision = module, optimizer, precision
        names = st.param_names(module)
        if optimizer is not None:
            self._group_names = st.group_names_of(optimizer, names)
        trainable = {n for p, n in names.items() if p.requires_grad}
        group_of = {n: g for g, group in enumerate(self._group_names) for n in group if n in trainable}
        groups = len(self._group_names) + 1  # the last holds parameters the optimizer does not train
        for handle in self._hooks:
            handle.remove()
        for mod in module.modules():  # parameters move unit by unit, as they are sharded
            for key, buf in mod._buffers.items():
                if buf is not None and not buf.is_meta:
                    mod._buffers[key] = buf.to(self.device)
        self._build_units(module, names)
        flats: list[FlatUnit] = []
        for unit in self.units:
            params = self._params_of[unit.index]
            for g in sorted({group_of.get(names[p], groups - 1) for p in params}):
                members = [p for p in params if group_of.get(names[p], groups - 1) == g]
                flat = FlatUnit.build(members, [names[p] for p in members], self.world_size, g)
                unit.flats.append(flat)
                flats.append(flat)
        # launch order for reduce-scatters: roughly backward order (last units first), root and persistent last
        ordered = [f for u in reversed(self.units) if not (u.root or u.persistent) for f in u.flats]
        ordered += [f for u in self.units if u.root or u.persistent for f in u.flats]
        for index, flat in enumerate(ordered):
            flat.index = index
        self._flats = ordered
        self._unit_of_flat = {f.index: u for u in self.units for f in u.flats}
        converts = self.precision.master_dtype != self.grad_dtype or (self.offload and self.device.type != "cpu")
        self._master = MasterShards(ordered, groups, self.precision.master_dtype, self.device, self.offload, self.ratio,
                                    host_grads=converts)
        for unit in self.units:
            self._materialise(unit)
        self._flat_of = {p: f for f in self._flats for p in f.params}
        self.comm.broadcast_coalesced([b for b in module.buffers() if not b.is_meta])
        self._launcher = OrderedLauncher([sum(p.requires_grad for p in f.params) for f in self._flats], self._launch)
        self._reducer = BucketReducer(self.comm, self.grad_dtype, self.device, max(f.padded for f in self._flats))
        if optimizer is not None:
            self._master.retarget(optimizer)
        self._install_hooks()
        for unit in self.units:
            if unit.persistent:
                self._gather(unit)

    def _build_units(self, module: nn.Module, names: dict[Tensor, str]) -> None:
        """Assign every parameter to one unit: the innermost unit among its owners' common ancestors."""
        groups = self.unit_modules(module)
        unit_of_module: dict[nn.Module, int] = {}
        parent: dict[int, int] = {}

        def visit(mod: nn.Module, current: int) -> None:
            for index, members in enumerate(groups, start=1):
                if any(mod is m for m in members):
                    parent.setdefault(index, current)
                    current = index
                    break
            unit_of_module[mod] = current
            for child in mod.children():
                visit(child, current)

        visit(module, 0)
        self.units = [Unit(0, [], root=True)] + [Unit(i, list(m)) for i, m in enumerate(groups, start=1)]

        def ancestors(index: int) -> list[int]:
            chain = [index]
            while chain[-1] != 0:
                chain.append(parent[chain[-1]])
            return chain

        owners: dict[Tensor, list[nn.Module]] = {}
        for mod in module.modules():
            for p in mod._parameters.values():
                if p is not None:
                    owners.setdefault(p, []).append(mod)
        self._params_of: dict[int, list[Tensor]] = {u.index: [] for u in self.units}
        persistent: list[Tensor] = []
        for p in names:
            if self.is_persistent(p):
                persistent.append(p)
                continue
            chains = [ancestors(unit_of_module[m]) for m in owners[p]]
            common = next(u for u in chains[0] if all(u in c for c in chains))
            self._params_of[common].append(p)
        if persistent:
            self.units.append(Unit(len(self.units), [], persistent=True))
            self._params_of[self.units[-1].index] = persistent
        self.units = [u for u in self.units if self._params_of[u.index]]

    def _materialise(self, unit: Unit) -> None:
        """Give the unit's parameters their values (initialising meta ones in place in the unit's fp32
        buffer, so a unit exists once), keep this rank's pieces, and turn the parameters into views of the
        (freed) gather buffer."""
        fulls = {f.index: torch.zeros(f.padded, dtype=torch.float32, device=self.device) for f in unit.flats}
        homes = {p: view for f in unit.flats for p, view in zip(f.params, f.param_views(fulls[f.index]), strict=True)}
        if any(p.is_meta for p in homes):
            self._initialise_meta(homes)
        for flat in unit.flats:
            flat.params = [self._current(p) for p in flat.params]
            full = fulls.pop(flat.index)
            for p, view in zip(flat.params, flat.param_views(full), strict=True):
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
            self.comm.broadcast(full, src=0)  # every rank starts from rank 0's values
            lo, hi = flat.piece_range(self.rank)
            master = self._master[flat]
            master.copy_(full[lo:hi])
            same = master.dtype == self.precision.working_dtype and master.device == self.device
            self._shard[flat.index] = master if same else full[lo:hi].to(self.precision.working_dtype)
            gathered = torch.empty(flat.padded, dtype=self.precision.working_dtype, device=self.device)
            for p, view in zip(flat.params, flat.param_views(gathered), strict=True):
                p.data, p.grad = view, None
            gathered.untyped_storage().resize_(0)
            self._full[flat.index] = gathered
            del full

    def _current(self, p: Tensor) -> Tensor:
        return self._replaced.get(p, p)

    def _initialise_meta(self, homes: dict[Tensor, Tensor]) -> None:
        """Materialise meta parameters, each new parameter a view of its place in ``homes`` (the unit's
        buffers), with the values ``configure_model`` computed (replayed from the init log), or, for a
        module whose tensors the log cannot rebuild, with its ``reset_parameters()``. A module is
        materialised once, all its parameters together, even those another unit shards (they get storage
        of their own)."""
        assert self.module is not None
        replayer = self._replayer
        for mod in self.module.modules():
            if not any(p is not None and p in homes and p.is_meta for p in mod._parameters.values()):
                continue
            metas = {n: p for n, p in mod._parameters.items() if p is not None and p.is_meta}
            buffers = {n: b for n, b in mod._buffers.items() if b is not None and b.is_meta}
            replay = replayer is not None and all(replayer.knows(t) for t in [*metas.values(), *buffers.values()])
            reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
            if not replay and reset is None:
                raise TypeError(
                    f"{type(mod).__name__} was built on the meta device (in configure_model) in a way trainkit "
                    "cannot replay, and has no reset_parameters() to initialise it; define reset_parameters() or "
                    "build this module in __init__ instead of configure_model."
                )
            if not replay and replayer is not None:
                rank_zero_warn(f"{type(mod).__name__}'s tensors were computed in configure_model in a way trainkit "
                               "cannot replay; they are initialised by its reset_parameters() instead, so they "
                               "differ from a one-process run.")
            for old in metas.values():
                home = homes.get(old)
                data = home if home is not None else torch.empty_like(old, device=self.device, dtype=torch.float32)
                new = nn.Parameter(data, requires_grad=old.requires_grad)
                for owner in self.module.modules():
                    for key, value in owner._parameters.items():
                        if value is old:
                            owner._parameters[key] = new
                self._replaced[old] = new
            for name, buf in buffers.items():
                mod._buffers[name] = torch.empty_like(buf, device=self.device)
            with torch.no_grad():
                if replay:
                    assert replayer is not None
                    for name, old in metas.items():
                        replayer.fill(old, mod._parameters[name].data)
                    for name, old in buffers.items():
                        replayer.fill(old, mod._buffers[name])
                else:
                    reset()
                    custom = getattr(self.module, "init_weights", None)
                    if callable(custom):  # the model's own initialisation, module by module
                        custom(mod)
        for mod in self.module.modules():  # buffers of modules without parameters
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta:
                    mod._buffers[name] = torch.zeros_like(buf, device=self.device)
                    if replayer is not None and replayer.knows(buf):
                        replayer.fill(buf, mod._buffers[name])

    def _install_hooks(self) -> None:
        hooks = []
        for unit in self.units:
            for mod in unit.modules:
                hooks.append(mod.register_forward_pre_hook(partial(self._pre_forward, unit)))
                hooks.append(mod.register_forward_hook(partial(self._post_forward, unit)))
                hooks.append(mod.register_full_backward_pre_hook(partial(self._pre_backward, unit)))
        hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._flat_of if p.requires_grad]
        self._hooks = hooks

    # -- gathering -----------------------------------------------------------------------------------
    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        """Start gathering ``unit`` unless it is (being) gathered; unless ``async_op``, wait until it is."""
        if not unit.gathered:
            unit.gathered = True
            for flat in unit.flats:
                full = self._full[flat.index]
                full.untyped_storage().resize_(flat.padded * full.element_size())
                unit.handles.append(self.comm.all_gather(full, self._shard[flat.index], async_op=True))
        if not async_op:
            self._wait(unit)

    def _wait(self, unit: Unit) -> None:
        for handle in unit.handles:
            handle.wait()
        unit.handles.clear()

    def _reshard(self, unit: Unit) -> None:
        if not unit.gathered or unit.persistent:
            return
        self._wait(unit)
        for flat in unit.flats:
            self._full[flat.index].untyped_storage().resize_(0)
        unit.gathered = False

    def _next_in_order(self, phase: str, unit: Unit) -> Unit | None:
        """Follow the order recorded on the first step; on a deviation stop prefetching (once, loudly)."""
        order, pos = self._order[phase], self._position[phase]
        if not self._recorded[phase]:
            order.append(unit.index)
            return None
        self._position[phase] = pos + 1
        if pos >= len(order) or order[pos] != unit.index:
            if self.prefetch:
                rank_zero_warn(f"{self.name}: the {phase} order of units changed since the first step; "
                               "prefetching is off from now on (results are unaffected).")
                self.prefetch = False
            return None
        if not self.prefetch or pos + 1 >= len(order):
            return None
        return next(u for u in self.units if u.index == order[pos + 1])

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast, and the root unit gathered for the step (until the end of backward when training)."""
        if self._order["forward"]:
            self._recorded["forward"] = True
        self._position["forward"] = 0
        for unit in self.units:
            unit.forward_calls = 0
            if unit.root:
                self._gather(unit)
        with self.precision.forward_context(self.device):
            yield
        if not torch.is_grad_enabled():
            for unit in self.units:
                self._reshard(unit)

    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        if _in_backward():  # recomputation under activation checkpointing
            self._gather(unit)
            return
        if unit.forward_calls == 0:
            nxt = self._next_in_order("forward", unit) if torch.is_grad_enabled() else None
            self._gather(unit)
            if nxt is not None:
                self._gather(nxt, async_op=True)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output: object) -> None:
        if _in_backward():  # recomputation: backward frees the unit once its gradients are reduced
            return
        unit.forward_calls += 1
        if unit.forward_calls < len(unit.modules):
            return
        unit.forward_calls = 0
        if self.reshard_after_forward:
            self._reshard(unit)

    def _pre_backward(self, unit: Unit, module: nn.Module, grad_output: tuple) -> None:
        self._queue_end_backward()
        nxt = self._next_in_order("backward", unit)
        self._gather(unit)
        if nxt is not None:
            self._gather(nxt, async_op=True)

    # -- gradients -----------------------------------------------------------------------------------
    def backward(self, loss: Tensor) -> None:
        self._launcher.reset()
        self._end_queued = False
        for unit in self.units:
            unit.pending_grads = sum(p.requires_grad for f in unit.flats for p in f.params)
        self._position["backward"] = 0
        with warnings.catch_warnings():  # the first unit's inputs never require grad; its pre-hook still fires
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            loss.backward()

    def _queue_end_backward(self) -> None:
        if not self._end_queued:
            Variable._execution_engine.queue_callback(self._end_backward)
            self._end_queued = True

    def _on_grad(self, param: Tensor) -> None:
        self._queue_end_backward()
        flat = self._flat_of[param]
        if self._syncing or self.sync_micro_steps:
            self._launcher.ready(flat.index)
            return
        unit = self._unit_of_flat[flat.index]  # gradients stay whole until the window's last backward,
        unit.pending_grads -= 1                 # but the unit's parameters can go once they are all in
        if unit.pending_grads == 0 and not unit.root:
            self._reshard(unit)

    def _launch(self, index: int) -> None:
        flat = self._flats[index]
        source = self._reducer.fill(flat)
        self._reducer.reduce(source, self._grad_shard(flat), accumulate=not self._first_micro_step)
        unit = self._unit_of_flat[index]
        unit.reduced_flats += 1
        if unit.reduced_flats == len(unit.flats):  # every gradient of the unit is in: its parameters can go
            unit.reduced_flats = 0
            if not unit.root:
                self._reshard(unit)

    def _grad_shard(self, flat: FlatUnit) -> Tensor:
        if not self._grad:
            total = sum(f.piece for f in self._flats)
            buffer = torch.zeros(total, dtype=self.grad_dtype, device=self.device)
            self._grad_flats = [buffer]
            offset = 0
            for f in self._flats:
                self._grad[f.index] = buffer[offset : offset + f.piece]
                offset += f.piece
        return self._grad[flat.index]

    def _end_backward(self) -> None:
        if self._syncing or self.sync_micro_steps:
            self._launcher.flush()
            self._reducer.finish()
            self._first_micro_step = False
        for unit in self.units:
            self._reshard(unit)
        self._recorded["backward"] = self._recorded["backward"] or bool(self._order["backward"])
        self._end_queued = False

    def reduce_gradients(self, scale: float | Tensor) -> None:
        self._launcher.flush()  # a window whose last backward ran under no_sync
        self._reducer.finish()
        self._launcher.reset()
        self._first_micro_step = True
        self._scale_local_grads(scale)

    def gradients(self) -> list[Tensor]:
        return list(self._grad_flats)

    # -- step ----------------------------------------------------------------------------------------
    def optimizer_step(self) -> None:
        assert self.optimizer is not None
        self._master.step(self.optimizer, self._grad_shard, self._take_grad_mult())
        self._refresh_shards()
        self.sync_buffers()

    def _refresh_shards(self) -> None:
        """Copy updated masters into the compute-dtype shards; re-gather what stays gathered."""
        for flat in self._flats:
            shard, master = self._shard[flat.index], self._master[flat]
            if shard is not master:
                shard.copy_(master)
        for unit in self.units:
            if unit.gathered:
                unit.gathered = False
                self._gather(unit)

    def zero_grad(self) -> None:
        self._grad_mult = 1.0  # a step skipped for overflow never consumed it
        for buffer in self._grad_flats:
            buffer.zero_()

    # -- inspection and state ------------------------------------------------------------------------
    def _gather_flats(self, piece_of: Callable[[FlatUnit], Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for flat in self._flats:
            piece = piece_of(flat).to(self.device)
            full = piece.new_empty(flat.padded)
            self.comm.all_gather(full, piece.contiguous())
            out |= dict(zip(flat.names, flat.param_views(full), strict=True))
        return out

    def full_parameters(self) -> dict[str, Tensor]:
        return self._gather_flats(lambda f: self._master[f])

    def full_gradients(self) -> dict[str, Tensor]:
        grads = self._gather_flats(lambda f: self._grad_shard(f).float())
        return {n: g * self._grad_mult for n, g in grads.items()}

    def state_layout(self) -> st.StateLayout:
        shapes, whole = self._whole_state(skip={n for f in self._flats for n in f.names})
        model, optimizer = self._master.holders(self.rank, self.optimizer)
        return st.StateLayout(shapes, whole + model, self.optimizer, optimizer, self._group_names)

    def _after_load(self) -> None:
        for flat in self._flats:
            if self._shard[flat.index] is not self._master[flat]:
                self._shard[flat.index].copy_(self._master[flat])
        self._refresh_shards()

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        split = self._master.split(self.optimizer)
        gathered = [t for t in self._full.values() if t.untyped_storage().nbytes()]
        grads = list(self._grad_flats) + [p.grad for p in self._flat_of if p.grad is not None]
        if self._reducer.buffer is not None:
            grads.append(self._reducer.buffer)
        return MemoryReport.of(
            {
                "params": list(self._shard.values()) + gathered,
                "grads": grads + split["device"]["grads"],
                "master": split["device"]["master"],
                "optimizer": split["device"]["optimizer"],
                "buffers": list(self.module.buffers()),
            },
            split["host"],
        )

    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class Zero3Strategy(ShardedStrategy):
    """DeepSpeed-style ZeRO-3: units are the modules that own parameters, consecutive ones bucketed up
    to ``bucket_mb`` per gather; parameters of at most ``persistence_threshold`` elements stay gathered.

    Args:
        bucket_mb: gather bucket size in MiB (consecutive parameter-owning modules share a gather).
        persistence_threshold: parameters with at most this many elements are never freed after gather.
        reshard_after_forward, prefetch, offload, ratio, reduce_dtype, broadcast_buffers: see ShardedStrategy.
    """

    name = "zero3"

    def __init__(self, bucket_mb: float = 25.0, persistence_threshold: int = 100_000,
                 reshard_after_forward: bool = True, prefetch: bool = True, offload: bool = False,
                 ratio: float = 1.0, reduce_dtype: str | None = None, broadcast_buffers: bool = True) -> None:
        super().__init__(reshard_after_forward, prefetch, offload, ratio, reduce_dtype, broadcast_buffers)
        if not bucket_mb > 0:
            raise ValueError(f"zero3 bucket_mb must be positive; got {bucket_mb}.")
        if persistence_threshold < 0:
            raise ValueError(f"zero3 persistence_threshold must be >= 0; got {persistence_threshold}.")
        self.bucket_mb, self.persistence_threshold = bucket_mb, persistence_threshold

    def is_persistent(self, param: Tensor) -> bool:
        return param.numel() <= self.persistence_threshold

    def unit_modules(self, module: nn.Module) -> list[list[nn.Module]]:
        limit = self.bucket_mb * 2**20
        buckets: list[list[nn.Module]] = []
        size = limit
        for mod in module.modules():
            own = [p for p in mod._parameters.values() if p is not None and not self.is_persistent(p)]
            if mod is module or not own:
                continue
            nbytes = sum(p.numel() * p.element_size() for p in own)
            if size + nbytes > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(mod)
            size += nbytes
        return buckets
