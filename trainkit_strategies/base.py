"""The Strategy contract: plain torch in, plain torch out.

A strategy owns everything between "the user's module and optimizer" and "one optimizer step on a
global batch": placement, sharding, gradient reduction, clipping, the step itself, and how its
state maps to universal checkpoints. It never imports trainkit, so it can be driven by hand::

    strategy = get_strategy("ddp")
    strategy.setup_environment(Environment.from_env("cpu"))
    strategy.setup(model, torch.optim.AdamW(model.parameters()), Precision.from_name("32"))
    loss = model(x).mean(); strategy.backward(loss)
    strategy.reduce_gradients(1.0 / strategy.world_size); strategy.optimizer_step(); strategy.zero_grad()

Optional abilities are separate small interfaces in ``capabilities.py``; callers test for them with
``isinstance(strategy, Capability)`` and never for a concrete strategy class.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from abc import ABC
from collections.abc import Collection, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies import state as st
from trainkit_strategies.capabilities import SelfReducing, check_optimizer, optimizer_extras
from trainkit_strategies.comm import Comm
from trainkit_strategies.environment import Environment
from trainkit_strategies.memory import MemoryReport
from trainkit_strategies.norms import local_norm
from trainkit_strategies.precision import Precision


class Strategy(ABC):
    """Base class of every strategy.

    The defaults here are the replicated case (every rank holds whole parameters and whole gradients)
    on one process; a strategy overrides what its algorithm changes: placement and sharding in
    ``setup``, communication in ``backward``/``reduce_gradients``, state in ``state_layout``.
    """

    name: ClassVar[str]
    broadcast_buffers = True  # data-parallel strategies overwrite replicas' float buffers with rank 0's
    accepts_self_reducing: ClassVar[bool] = False  # runs optimizers that average across ranks themselves
    data_axis: ClassVar[str] = "dp_replicate"  # the layout axis its ranks form: replicas, or "dp_shard" (shards)
    hybrid: ClassVar[bool] = False  # its shards can be replicated (setup_environment's replicas: HSDP) and its group
    # can hold context-parallel ranks (gradients summed over a sequence's chunks)
    splits_backward: ClassVar[bool] = True  # a backward may leave its weight gradients to a later pass (zero bubble)

    def __init__(self) -> None:
        self.env = Environment()
        self.comm = Comm()
        self.module: nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self.precision = Precision.from_name("32")
        self._group_names: list[list[str]] = []
        self._syncing = True

    def ability(self, kind: type) -> Any:
        """What gives this strategy the capability ``kind`` (an interface of ``capabilities.py``): the strategy itself
        where it implements it, a part it is composed of (a layout's pipeline runs the schedules), or None. Callers
        use ``capabilities.capability``."""
        return self if isinstance(self, kind) else None

    # -- environment -------------------------------------------------------------------------------
    def setup_environment(self, env: Environment, comm: Comm | None = None) -> None:
        """Join the process group (if any) and pin the device. A composing strategy (pipeline stages
        replicated by ddp, say) passes the ``comm`` of the subgroup this one works in."""
        self.env = env
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)
        self.comm = comm if comm is not None else Comm.connect(env)

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.env.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (what the sampler shards by)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def item_ranks(self) -> int:
        """Ranks whose micro-batches hold different items (the data-parallel ones; with context parallelism also
        the ranks holding other chunks of the same sequences): a plain loss's sample total is this many times a
        rank's when every rank's batches are as large."""
        return self.dp_size

    def local_batch(self, batch: Any) -> Any:
        """What of ``batch`` this rank computes on (the whole batch; under context parallelism its slice of every
        sequence). The loops call it before ``training_step``, ``validation_step`` and ``test_step``."""
        return batch

    # -- model and optimizer -----------------------------------------------------------------------
    def setup(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        """Place (and shard) ``module``; re-target ``optimizer`` in place onto what this rank owns.

        The optimizer object stays the user's (LR schedulers hold a reference to it); a sharded
        strategy replaces the tensors in each param group and keeps every group's hyperparameters.
        """
        self._bind(module, optimizer, precision)
        self._place(module)

    def _bind(self, module: nn.Module, optimizer: Optimizer | None, precision: Precision) -> None:
        """Take ``module``, ``optimizer`` and ``precision`` on, recording the optimizer's param groups by name."""
        check_optimizer(self, optimizer)
        self.module, self.optimizer, self.precision = module, optimizer, precision
        if optimizer is not None:
            self._group_names = st.group_names_of(optimizer, st.param_names(module))

    def _place(self, module: nn.Module) -> None:
        """Move what ``module`` holds that is not on the device yet there (parameters, buffers, and what a module's
        own ``_apply`` moves, such as torchmetrics states), cast to the policy's parameter dtype. A sharding
        strategy calls it after placing its shards, for the rest; tensors still on the meta device stay."""
        device, dtype = self.device, self.precision.param_dtype

        def target(t: Tensor) -> tuple[torch.device, torch.dtype]:
            return device, dtype if dtype != torch.float32 and t.is_floating_point() else t.dtype

        def placed(t: Tensor) -> bool:
            return (t.is_meta and device.type != "meta") or (t.device, t.dtype) == target(t)

        def move(t: Tensor) -> Tensor:
            return t if placed(t) else t.to(*target(t))

        for mod in module.modules():  # only modules holding something to move (a sharded unit holds nothing)
            own = [t for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None]
            if type(mod)._apply is not nn.Module._apply:  # it moves more than parameters and buffers
                mod._apply(move)
            elif not all(placed(t) for t in own):
                mod._apply(move, recurse=False)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.precision.forward_context(self.device)

    def backward(self, loss: Tensor, gradient: Tensor | None = None) -> None:
        """``loss.backward(gradient)`` (``gradient``: for a non-scalar output, as a pipeline stage has), inside
        ``backward_pass``."""
        with self.backward_pass():
            loss.backward(gradient)

    @contextlib.contextmanager
    def backward_pass(self) -> Iterator[None]:
        """Around one autograd pass that accumulates parameter gradients: a backward, or the weight-gradient
        pass of a zero-bubble pipeline schedule. Strategies whose gradient hooks count what each pass brings
        reset the count here."""
        yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context for accumulation micro-steps: ``self._syncing`` is False inside, and a strategy skips
        the gradient communication its algorithm can defer to the window's last backward."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def reduce_gradients(self, scale: float | Tensor) -> None:
        """Finish this window's gradient reduction (sum over ranks) and multiply the result by ``scale``.

        ``scale`` folds together the loss normalisation (1/W for a plain mean, or c/N for ``num_items``)
        and the loss-scaler's unscale, so gradients are touched once.
        """
        self._scale_local_grads(scale)

    def gradients(self) -> list[Tensor]:
        """The gradient tensors this rank holds (whole or shards), for norms and scaling."""
        assert self.module is not None
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def keep_apart(self, params: Collection[Tensor]) -> None:
        """Hold the gradients of ``params`` apart from the others' (called before ``setup``), so that a strategy
        composing this one can name them: ``gradients_of(params)`` (to sum them across the ranks that share the
        parameters: tensor-parallel replicas, stages tied by a shared weight) and ``grad_norm(exclude=params)`` (to
        count them once). Strategies holding whole gradients hold each apart already."""

    def gradients_of(self, params: Collection[Tensor]) -> list[Tensor]:
        """The gradient tensors this rank holds for exactly ``params`` (whole, or the shards ``keep_apart`` set up)."""
        return [p.grad for p in params if p.grad is not None]

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        """The global gradient norm: shards combined across ranks where the strategy shards. ``exclude``: parameters
        (kept apart) whose gradients another rank counts."""
        return local_norm(self._counted(exclude), norm_type, self.device)

    def _counted(self, exclude: Collection[Tensor]) -> list[Tensor]:
        if not exclude:
            return self.gradients()
        assert self.module is not None
        skip = {id(p) for p in exclude}
        return [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]

    def scale_grads(self, factor: float | Tensor) -> None:
        self._scale_local_grads(factor)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, norm: Tensor | None = None) -> Tensor:
        """Clip by the global norm, as torch.nn.utils.clip_grad_norm_ does; returns the norm."""
        if norm is None:
            norm = self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self.scale_grads(coef)
        return norm

    def clip_grad_value(self, value: float) -> None:
        grads = self.gradients()
        if grads:
            torch._foreach_clamp_min_(grads, -value)
            torch._foreach_clamp_max_(grads, value)

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter whole, by name, on every rank (collective where parameters are sharded)."""
        assert self.module is not None
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def full_gradients(self) -> dict[str, Tensor]:
        """Every reduced gradient whole, by name (collective where gradients are sharded); call it between
        ``reduce_gradients`` and ``zero_grad``. Parameters without a gradient are left out."""
        assert self.module is not None
        return {n: p.grad.detach() for n, p in self.module.named_parameters() if p.grad is not None}

    def optimizer_step(self) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def trainable(self) -> list[Tensor]:
        """The parameters this rank computes gradients for (a pipeline stage's, say)."""
        assert self.module is not None
        return [p for p in self.module.parameters() if p.requires_grad]

    def comms(self) -> list[Comm]:
        """Every communicator this strategy moves data through (their stats together are its traffic)."""
        return [self.comm]

    def comms_by_axis(self) -> dict[str, list[Comm]]:
        """``comms()`` by the axis of the layout they run along ("dp" for a one-axis data-parallel strategy; "tp",
        "pp", "dp_shard", "dp_replicate" on a mesh): what a plan reports as bytes per step per axis."""
        return {"dp": self.comms()}

    # -- planning (``trainkit estimate``): a strategy describes itself, so the planner knows no strategy by name --
    def unfit_for(self, module: nn.Module, optimizer: Optimizer | None) -> str | None:
        """Why this strategy cannot train ``module`` with ``optimizer`` (None: it can)."""
        if isinstance(optimizer, SelfReducing) and not self.accepts_self_reducing:
            return f"{type(optimizer).__name__} does not run under {self.name}"
        return None

    def planned(self, module: nn.Module, world_size: int) -> tuple[Strategy, list[int]]:
        """This strategy as it would train ``module`` on ``world_size`` ranks (options left to it decided), and the
        ranks whose plans differ enough to compare for the heaviest (not rank 0: uneven shards pad the last ranks; a
        pipeline's stages)."""
        return self, [1 if world_size > 1 else 0]

    def describe(self) -> str:
        """After setup: what a plan's note says of this rank's share (a pipeline's stages, a mesh's layout)."""
        return ""

    def activation_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``model`` (a meta copy of the user's module) rewritten as this rank computes it, for tracing the
        activations a rank saves (tensor-parallel layers compute on slices); the model itself by default."""
        return model

    def settle(self) -> None:
        """Finish work a strategy keeps in flight across steps (a delayed parameter update, say), so the working
        parameters hold every step taken. Collective; the Trainer calls it before evaluating and after fit."""

    def sync_buffers(self) -> None:
        """Broadcast rank 0's floating-point buffers (BatchNorm running statistics, say) to every rank, in one
        coalesced collective per dtype; data-parallel strategies call it after each optimizer step, so all
        replicas evaluate and checkpoint the same statistics. Integer buffers (counters) are left alone."""
        if not (self.broadcast_buffers and self.comm.active and self.module is not None):
            return
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        if buffers:
            self.comm.broadcast_coalesced(buffers)

    def _scale_local_grads(self, factor: float | Tensor) -> None:
        if isinstance(factor, float | int) and factor == 1.0:
            return
        grads = self.gradients()
        if not grads:
            return
        if isinstance(factor, Tensor):
            factor = factor.to(grads[0].device)
        torch._foreach_mul_(grads, factor)

    # -- collectives for metrics and control flow (no communication on one rank) ------------------
    def reduce(self, tensor: Tensor, op: str = "mean") -> Tensor:
        """Reduce across ranks into a new tensor: "mean", "sum", "max" or "min"."""
        if not self.comm.active:
            return tensor
        out = tensor.detach().clone().to(self.device)
        self.comm.all_reduce(out, "sum" if op == "mean" else op)
        return out / self.world_size if op == "mean" else out

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Stack every rank's ``tensor`` (same shape on all ranks) along a new first dimension."""
        src = tensor.detach().contiguous().to(self.device)
        out = src.new_empty((self.world_size, *src.shape))
        self.comm.all_gather(out.view(-1), src.view(-1))
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.comm.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.comm.broadcast_object(obj, src)

    def barrier(self) -> None:
        self.comm.barrier()

    # -- state -------------------------------------------------------------------------------------
    def state_layout(self) -> st.StateLayout:
        """Describe the model and optimizer state this rank holds (replicated: everything, whole)."""
        shapes, model = self._whole_state(skip=set())
        holders = []
        if self.optimizer is not None:
            names = st.param_names(self.module)
            holders = [st.whole_holder(names[p], p, self.is_global_zero)
                       for g in self.optimizer.param_groups for p in g["params"]]
        return st.StateLayout(shapes, model, self.optimizer, holders, self._group_names)

    def _whole_state(self, skip: set[str]) -> tuple[dict[str, tuple[int, ...]], list[st.Holder]]:
        """Global shapes of every parameter and persistent buffer, and whole holders (rank 0 writes)
        for those not named in ``skip`` (the ones a sharded strategy describes itself)."""
        assert self.module is not None
        names = st.param_names(self.module)
        buffers = st.persistent_buffers(self.module)
        shapes = {n: tuple(p.shape) for p, n in names.items()} | {n: tuple(b.shape) for n, b in buffers}
        writer = self.is_global_zero
        holders = [st.whole_holder(n, p, writer) for p, n in names.items() if n not in skip]
        holders += [st.whole_holder(n, b, writer) for n, b in buffers]
        return shapes, holders

    def state_pieces(self) -> list[st.Piece]:
        prefix = self._local_prefix()
        local = [st.Piece(f"{prefix}{key}", tuple(t.shape), t.dtype, 0, t.numel(), t.detach().reshape(-1))
                 for key, t in self.local_state().items()]
        return st.collect_pieces(self.state_layout()) + local

    def local_state(self) -> dict[str, Tensor]:
        """State that differs between ranks and means something only at this world size (the error feedback of
        compressed communication). Checkpoints keep it under ``local/W<world>/rank<r>/``; a run resumed at
        another world size starts it afresh."""
        if isinstance(self.optimizer, SelfReducing):
            return {f"optimizer/{k}": v for k, v in self.optimizer.local_state().items()}
        return {}

    def load_local_state(self, state: dict[str, Tensor]) -> None:
        """Restore ``local_state`` (empty: start it afresh)."""
        if isinstance(self.optimizer, SelfReducing):
            self.optimizer.load_local_state({k[10:]: v for k, v in state.items() if k.startswith("optimizer/")})

    def _local_prefix(self) -> str:
        return f"local/W{self.world_size}/rank{self.rank}/"

    def optimizer_groups(self) -> list[dict]:
        """Param groups as names plus hyperparameters (JSON-ready)."""
        if self.optimizer is None:
            return []
        hyper = st.group_hyperparameters(self.optimizer)
        return [{"params": names, **h} for names, h in zip(self._group_names, hyper, strict=True)]

    def load_state(self, reader: st.Reader, groups: Sequence[dict] | None) -> None:
        """Fill model (and, when ``groups`` is given, optimizer) state from any checkpoint's ranges."""
        layout = self.state_layout()
        st.load_model(layout, reader)
        if groups is not None:
            st.load_optimizer(layout, reader, groups)
            self._load_local(reader)
        self._after_load()

    def _load_local(self, reader: st.Reader) -> None:
        prefix = self._local_prefix()
        state = {}
        for key in reader.keys():
            if key.startswith(prefix):
                shape, _ = reader.info(key)
                state[key[len(prefix):]] = reader.read(key, 0, math.prod(shape)).view(shape).to(self.device)
        if not state and any(k.startswith("local/") for k in reader.keys()):
            warnings.warn(
                f"The checkpoint holds rank-local state (compression error feedback) for another world size than "
                f"this run's {self.world_size}; it starts from zero here.", stacklevel=2,
            )
        self.load_local_state(state)

    def _after_load(self) -> None:
        """Hook for strategies whose working copies derive from loaded masters."""

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        opt_state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, Tensor)
        ]
        return MemoryReport.of({
            "params": list(self.module.parameters()),
            "grads": self.gradients(),
            "master": [],
            "optimizer": opt_state + optimizer_extras(self),  # with compression's error feedback
            "buffers": list(self.module.buffers()),
        })

    def teardown(self) -> None:
        """Release communication resources; the module stays usable on this rank."""
