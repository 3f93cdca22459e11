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
from abc import ABC
from collections.abc import Collection, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.capabilities import check_optimizer
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.communication.norms import local_norm
from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.parts import GradientParts
from trainkit_strategies.planning.reports import Planning
from trainkit_strategies.precision import Precision
from trainkit_strategies.ranks import Ranks
from trainkit_strategies.state import pieces as st
from trainkit_strategies.state.checkpointing import Checkpointing


class Strategy(Ranks, GradientParts, Checkpointing, Planning, ABC):
    """Base class of every strategy.

    The class itself is the step's contract: ``setup_environment``, ``setup``, ``local_batch``, ``forward_context``,
    ``backward``, ``no_sync``, ``reduce_gradients``, ``grad_norm``, ``clip_grad_norm``, ``clip_grad_value``,
    ``optimizer_step``, ``zero_grad``, ``sync_buffers``, ``settle``, ``teardown`` (and ``ability``, which answers
    for the optional capabilities). Its parts, each in a file of its own: ``Ranks`` (where this rank is, collectives
    for metrics), ``GradientParts`` (what a composing strategy asks about gradients), ``Checkpointing`` (state as
    pieces of whole tensors), ``Planning`` (what the planner and telemetry learn).

    The defaults are the replicated case (every rank holds whole parameters and whole gradients)
    on one process; a strategy overrides what its algorithm changes: placement and sharding in
    ``setup``, communication in ``backward``/``reduce_gradients``, state in ``state_layout``.
    """

    name: ClassVar[str]
    broadcast_buffers = True  # data-parallel strategies overwrite replicas' float buffers with rank 0's
    accepts_self_reducing: ClassVar[bool] = False  # runs optimizers that average across ranks themselves
    accepts_new_groups: ClassVar[bool] = True  # takes param groups added, and parameters unfrozen, mid-run
    data_axis: ClassVar[str] = "dp_replicate"  # the layout axis its ranks form: replicas, or "dp_shard" (shards)
    hybrid: ClassVar[bool] = False  # its shards can be replicated (setup_environment's replicas: HSDP) and its group
    # can hold context-parallel ranks (gradients summed over a sequence's chunks)
    splits_backward: ClassVar[bool] = True  # a backward may leave its weight gradients to a later pass (zero bubble)
    manual_optimization: ClassVar[bool] = True  # steps whenever its caller says, over a window of any backwards, one
    # optimizer of several at a time (Lightning's manual optimization): not where steps run in backward or by stage
    any_reduce_dtype: ClassVar[bool] = False  # reduces gradients in the precision policy's reduce_dtype, whatever it
    # is (it keeps them in buffers of its own); otherwise in the parameters' dtype, where autograd leaves them

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

    def setup_environment(self, env: Environment, comm: Comm | None = None) -> None:
        """Join the process group (if any) and pin the device. A composing strategy (pipeline stages
        replicated by ddp, say) passes the ``comm`` of the subgroup this one works in."""
        self.env = env
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)
        self.comm = comm if comm is not None else Comm.connect(env)

    def local_batch(self, batch: Any) -> Any:
        """What of ``batch`` this rank computes on (the whole batch; under context parallelism its slice of every
        sequence). The loops call it before ``training_step``, ``validation_step`` and ``test_step``."""
        return batch

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
        reduce_dtype = precision.reduce_dtype
        if not (self.any_reduce_dtype or reduce_dtype in (None, precision.param_dtype)):
            raise ConfigurationError(
                f"{self.name} sums gradients in the parameters' dtype ({precision.param_dtype}), where autograd leaves "
                f"them, and cannot reduce them in reduce_dtype={reduce_dtype}: leave reduce_dtype unset, or use a "
                "strategy that keeps gradients in buffers of their own (zero1, zero2, zero_offload, zero3, fsdp, or "
                "parallel with one of them).")
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

    def backward(self, loss: Tensor, gradient: Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False) -> None:
        """``loss.backward(gradient, retain_graph, create_graph)`` (``gradient``: for a non-scalar output, as a pipeline
        stage has), inside ``backward_pass``."""
        with self.backward_pass():
            loss.backward(gradient, retain_graph=retain_graph, create_graph=create_graph)

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

    def grad_norm(self, norm_type: float = 2.0, exclude: Collection[Tensor] = ()) -> Tensor:
        """The global gradient norm: shards combined across ranks where the strategy shards. ``exclude``: parameters
        (kept apart) whose gradients another rank counts."""
        return local_norm(self._counted(exclude), norm_type, self.device)

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

    def optimizer_step(self) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

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

    def teardown(self) -> None:
        """Release communication resources; the module stays usable on this rank."""
