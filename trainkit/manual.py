"""Manual optimization, as Lightning spells it: ``automatic_optimization = False``, then ``self.optimizers()``,
``self.manual_backward(loss)``, ``opt.step()``, ``opt.zero_grad()`` in ``training_step``.

Every optimizer step closes a gradient window through the strategy, the way an automatic step does: the window's
gradients are reduced (summed over the data-parallel ranks and divided by their number, so a rank's mean loss gives
the mean over every rank's samples, as DDP's averaging does), unscaled and checked under fp16 loss scaling, clipped
where ``clip_gradients`` asked, and the optimizer steps; then every gradient of the window is released. A backward
therefore communicates nothing (``no_sync``): a window may hold several of them (accumulation by the user), and is
reduced once, when an optimizer steps.

Several optimizers reach the strategy as one ``OptimizerSet`` whose param groups are theirs (the same dicts, so a
sharding strategy re-targets each optimizer onto its own parameters' pieces, and each holds state for those only);
a step runs the one optimizer stepping. Releasing the window's gradients at that step is what Lightning's programs
do when they ``toggle_optimizer`` (the other optimizers' parameters get no gradient) or zero an optimizer's
gradients before its backward. A program whose numbers would depend on another optimizer's gradients outliving a
step (accumulating them across it, or clipping or overflow-checking while they are pending) gets an error naming
the fix, never a different result: each parameter's gradient is tracked by a hook while several optimizers train.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit.dispatch import HookDispatch
from trainkit.errors import ConfigurationError
from trainkit.finite import FiniteGuard
from trainkit.hooks import StepTiming
from trainkit.optim import OptimizerConfig
from trainkit.step import close_window
from trainkit_strategies import Precision, Strategy
from trainkit_strategies.capabilities import SelfReducing
from trainkit_strategies.communication.liveness import activity
from trainkit_strategies.experts.auxiliary import collecting
from trainkit_strategies.state import pieces as st

MANUAL_STRATEGIES = "single, ddp, zero1, zero2, zero3 and fsdp"


class _States(Mapping):
    """Every member optimizer's ``state``, read as one (what a strategy reads for checkpoints and memory)."""

    def __init__(self, members: list[Optimizer]) -> None:
        self.members = members

    def __getitem__(self, key: Any) -> Any:
        for member in self.members:
            if key in member.state:
                return member.state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for member in self.members:
            yield from member.state

    def __len__(self) -> int:
        return sum(len(m.state) for m in self.members)

    def clear(self) -> None:
        for member in self.members:
            member.state.clear()


class OptimizerSet(Optimizer):
    """Several optimizers as the one a strategy takes: their param groups in order (the very dicts, so re-targeting
    one re-targets its optimizer), their states read as one, and ``step`` running the optimizers ``only`` names."""

    def __init__(self, members: list[Optimizer]) -> None:  # no Optimizer.__init__: the members hold the groups
        for member in members:
            if isinstance(member, SelfReducing):
                raise ConfigurationError(f"{type(member).__name__} compresses the ranks' communication itself and "
                                         "cannot be one of several optimizers; use it alone.")
        self.members = members
        self.defaults: dict[str, Any] = {}
        self._active: tuple[int, ...] = tuple(range(len(members)))

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for m in self.members for g in m.param_groups]

    @property
    def state(self) -> _States:  # type: ignore[override]
        return _States(self.members)

    @contextlib.contextmanager
    def only(self, index: int) -> Iterator[None]:
        """``step`` runs member ``index`` alone inside."""
        previous, self._active = self._active, (index,)
        try:
            yield
        finally:
            self._active = previous

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        for index in self._active:
            self.members[index].step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for member in self.members:
            member.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigurationError("A param group cannot be added to several optimizers at once; trainkit takes groups "
                                 "added during a run with one optimizer only. Give configure_optimizers every group.")

    def state_dict(self) -> dict[str, Any]:
        state, groups, offset = {}, [], 0
        for member in self.members:
            saved = member.state_dict()
            state |= {offset + k: v for k, v in saved["state"].items()}
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in saved["param_groups"]]
            offset += sum(len(g["params"]) for g in member.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split a state dict in the members' order (indices run across the members' groups, as ``state_dict``)."""
        groups, offset = list(state_dict["param_groups"]), 0
        for member in self.members:
            mine, groups = groups[: len(member.param_groups)], groups[len(member.param_groups):]
            count = sum(len(g["params"]) for g in member.param_groups)
            state = {k - offset: v for k, v in state_dict["state"].items() if offset <= k < offset + count}
            member.load_state_dict({"state": state, "param_groups": [
                {**g, "params": [i - offset for i in g["params"]]} for g in mine]})
            offset += count

    def __repr__(self) -> str:
        return f"OptimizerSet({', '.join(type(m).__name__ for m in self.members)})"


def strategy_optimizer(config: OptimizerConfig) -> Optimizer:
    """The optimizer the strategy takes: the only one, or an ``OptimizerSet`` of several."""
    return config.optimizers[0] if len(config.optimizers) == 1 else OptimizerSet(config.optimizers)


class ManualOptimizer:
    """What ``self.optimizers()`` gives under manual optimization: the user's optimizer, whose ``step`` and
    ``zero_grad`` go through the strategy (Lightning's ``LightningOptimizer``). Other attributes (``param_groups``,
    ``state``, ...) are the optimizer's own."""

    def __init__(self, manual: ManualStep, index: int, optimizer: Optimizer) -> None:
        self._manual, self._index, self.optimizer = manual, index, optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run ``closure`` (a forward and ``manual_backward``) if given, then close the window with this optimizer's
        step."""
        result = closure() if closure is not None else None
        self._manual.close(self._index)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this optimizer's gradients (a step has already released the window's)."""
        self._manual.zero(self._index)

    @contextlib.contextmanager
    def toggle_model(self) -> Iterator[None]:
        """Only this optimizer's parameters require gradients inside (Lightning's ``toggle_model``)."""
        module = self._manual.module
        module.toggle_optimizer(self)
        try:
            yield
        finally:
            module.untoggle_optimizer(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"ManualOptimizer({self.optimizer!r})"


class ManualStep:
    """The loop's step under manual optimization: ``training_step`` runs the backwards and steps itself; the loop
    learns how many optimizer steps a batch took (``taken``), each one a global step, as in Lightning.

    Args:
        strategy: runs backward, reduction, clipping and the steps.
        precision: the policy's loss scale weights each backward; it decides fp16 skips.
        hooks: ``on_before_backward``, ``on_after_backward`` and ``on_before_optimizer_step`` are dispatched.
        config: the optimizers and schedulers from ``configure_optimizers`` (schedulers are the user's to step).
        module: the TrainModule; its parameters are matched to optimizers by name (the strategy may have swapped
            the optimizers' tensors for its own pieces).
        owners: each parameter name's optimizer index, read before the strategy's setup.
        guard: notices non-finite losses and gradient norms (``finite.py``).
    """

    k = 1  # the loop's accumulation: one batch per call; windows are the user's

    def __init__(self, strategy: Strategy, precision: Precision, hooks: HookDispatch, config: OptimizerConfig,
                 module: nn.Module, owners: dict[str, int], guard: FiniteGuard) -> None:
        self.strategy, self.precision, self.hooks, self.config, self.module = strategy, precision, hooks, config, module
        self.guard = guard
        self.optimizers = [ManualOptimizer(self, i, o) for i, o in enumerate(config.optimizers)]
        self.window = 0
        self.items_norm: float | None = None  # kept in loop checkpoints alike
        self.last_loss: Tensor | None = None
        self.timing = StepTiming(0.0, 0.0)
        self.taken = 0  # optimizer steps the last batch took
        self._taken = 0
        self._optimizer_s = 0.0
        self._clip: dict[int, tuple[float, str]] = {}
        self._pending: set[int] = set()  # optimizers whose parameters got a gradient in the open window
        self._lost: set[int] = set()  # optimizers whose pending gradients a step released and that have not zeroed
        self.params_of: list[list[nn.Parameter]] = [[] for _ in config.optimizers]
        for name, param in module.named_parameters():
            if name in owners:
                self.params_of[owners[name]].append(param)
        self._hooks = []
        if len(config.optimizers) > 1:
            for index, params in enumerate(self.params_of):
                for param in params:
                    self._hooks.append(param.register_post_accumulate_grad_hook(
                        lambda _, i=index: self._pending.add(i)))
        self._toggled: dict[nn.Parameter, bool] = {}
        self.with_batch_idx = True  # training_step takes batch_idx (the fit loop asks once: ``takes_batch_idx``)
        self._open = False  # a backward ran since the window's last step or zero_grad
        self._groups = len(strategy.optimizer.param_groups) if strategy.optimizer is not None else 0

    # -- the loop's side -----------------------------------------------------------------------------
    def micro_step(self, module: nn.Module, batch: Any, batch_idx: int, boundary: bool) -> Any:
        start = time.perf_counter()
        self._taken, self._optimizer_s = 0, 0.0
        batch = self.strategy.local_batch(batch)
        with self.strategy.forward_context(), collecting(module) as auxiliary:
            outputs = module.training_step(batch, batch_idx) if self.with_batch_idx else module.training_step(batch)
        if auxiliary:
            raise ConfigurationError(
                f"{type(module).__name__}'s layers added auxiliary losses (a MoE's load-balancing terms), which only "
                "automatic optimization adds to the loss it back-propagates: train it with automatic optimization.")
        self.window = 1 if self._pending else 0
        elapsed = time.perf_counter() - start
        self.timing = StepTiming(elapsed - self._optimizer_s, self._optimizer_s)
        return outputs

    def step(self) -> bool | None:
        """None when the batch took no optimizer step; otherwise True (``taken`` says how many)."""
        self.taken = self._taken
        return True if self._taken else None

    def step_scheduler(self, interval: str, count: int, metrics: Callable[[], dict[str, float]]) -> None:
        """Nothing: under manual optimization the user steps the schedulers (``self.lr_schedulers()``)."""

    def release(self) -> None:
        """The gradient hooks off the module's parameters (the fit is over) and any toggled flags restored."""
        self.untoggle()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- the module's side ---------------------------------------------------------------------------
    def backward(self, loss: Tensor, gradient: Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False, **unknown: Any) -> None:
        """``manual_backward``: this rank's ``loss`` back-propagated (times the loss scale), with no communication;
        the window's gradients are reduced when an optimizer steps. ``Tensor.backward``'s arguments but ``inputs``."""
        if unknown:
            raise TypeError(f"manual_backward takes loss.backward's gradient, retain_graph and create_graph; got "
                            f"{sorted(unknown)}.")
        for fn in self.hooks.fns("on_before_backward"):
            fn(loss)
        activity.enter("backward")
        scaled = loss * self.precision.loss_scale if self.precision.loss_scaling else loss
        with self.strategy.no_sync():
            self.strategy.backward(scaled, gradient, retain_graph, create_graph)
        self._open = True
        for fn in self.hooks.fns("on_after_backward"):
            fn()
        self.last_loss = loss.detach()
        self.guard.add_loss(self.last_loss)

    def clip(self, index: int, value: float, algorithm: str) -> None:
        """``clip_gradients``: applied to the reduced gradients when optimizer ``index`` steps next."""
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value'; got {algorithm!r}.")
        self._clip[index] = (value, algorithm)

    def zero(self, index: int) -> None:
        """``opt.zero_grad()``: drop optimizer ``index``'s gradients of the open window (all of the window's when no
        other optimizer holds any; a subset cannot be dropped from a window reduced as one, so that is refused)."""
        self._lost.discard(index)
        several = len(self.params_of) > 1
        if several and index not in self._pending:
            return
        others = self._pending - {index}
        if others:
            raise ConfigurationError(
                f"{_name(self.config.optimizers, index)}.zero_grad() while "
                f"{', '.join(_name(self.config.optimizers, i) for i in sorted(others))} also hold gradients of this "
                "window: trainkit reduces a window's gradients as one and cannot drop one optimizer's alone. Call "
                "self.toggle_optimizer(opt) around each optimizer's backward and step, as Lightning's GAN example "
                "does.")
        if self._open:
            self.strategy.zero_grad()
        self._pending.clear()
        self._open = False

    def close(self, index: int) -> None:
        """Optimizer ``index`` steps: reduce the window, unscale and check, clip, step it, release the window."""
        start = time.perf_counter()
        name = _name(self.config.optimizers, index)
        if index in self._lost:
            raise ConfigurationError(
                f"{name} steps on gradients that another optimizer's step released: trainkit reduces a window's "
                "gradients once, when an optimizer steps, and releases them all. Call zero_grad() on it before its "
                "backward, or toggle_optimizer(opt) around each optimizer's backward and step, as Lightning's GAN "
                "example does.")
        others = sorted(self._pending - {index})
        clip = self._clip.pop(index, None)
        if others and (clip is not None or self.precision.loss_scaling or not self.guard.records):
            raise ConfigurationError(
                f"{name} steps while {', '.join(_name(self.config.optimizers, i) for i in others)} also hold "
                "gradients of this window, which its gradient norm (for clipping, the fp16 overflow check or "
                "on_nonfinite='skip') would count. Call self.toggle_optimizer(opt) before the backward of each "
                "optimizer's loss (and untoggle_optimizer after its step), as Lightning's GAN example does.")
        self._lost |= set(others)
        if len(self.params_of) > 1 and len(self.strategy.optimizer.param_groups) != self._groups:
            raise ConfigurationError(
                "A param group was added to one of several optimizers (add_param_group, BaseFinetuning): trainkit "
                "takes groups added during a run with one optimizer only. Give every group to configure_optimizers.")
        activity.enter("the optimizer step")
        strategy, target = self.strategy, self.strategy.optimizer
        scale = 1.0 / strategy.item_ranks
        if self.precision.loss_scaling:
            scale = scale / self.precision.loss_scale

        def step() -> None:
            with target.only(index) if isinstance(target, OptimizerSet) else contextlib.nullcontext():
                strategy.optimizer_step()

        close_window(strategy, self.precision, self.guard, self.hooks, scale, self.config.optimizers[index], clip, step,
                     zero_hooks=False)
        self._open = False
        self._pending.clear()
        self._taken += 1
        self._optimizer_s += time.perf_counter() - start

    def toggle(self, index: int) -> None:
        """Only optimizer ``index``'s parameters require gradients (the others' flags are remembered), as
        Lightning's ``toggle_optimizer``."""
        if self._toggled:
            raise RuntimeError("toggle_optimizer was called while another optimizer is toggled: call "
                               "untoggle_optimizer first.")
        for i, params in enumerate(self.params_of):
            if i != index:
                for param in params:
                    self._toggled[param] = param.requires_grad
                    param.requires_grad_(False)

    def untoggle(self) -> None:
        for param, flag in self._toggled.items():
            param.requires_grad_(flag)
        self._toggled = {}


def _name(optimizers: list[Optimizer], index: int) -> str:
    return f"optimizer {index} ({type(optimizers[index]).__name__})"


def owners_by_name(config: OptimizerConfig, module: nn.Module) -> dict[str, int]:
    """Each trained parameter's name and the index of the optimizer training it (read before a strategy's setup
    swaps the optimizers' tensors)."""
    names = st.param_names(module)
    return {names[p]: i for i, o in enumerate(config.optimizers) for g in o.param_groups for p in g["params"]
            if p in names}


def check_manual(strategy: Strategy, config: OptimizerConfig, manual: bool, accumulate: int,
                 clip: float | None) -> None:
    """Refuse, naming the fix, what manual optimization or several optimizers cannot run with."""
    several = len(config.optimizers) > 1
    if several and not manual:
        raise ConfigurationError(
            f"configure_optimizers returned {len(config.optimizers)} optimizers. Training with several optimizers "
            "needs manual optimization, as in Lightning 2.x: set self.automatic_optimization = False in __init__, then "
            "in training_step take them with opt1, opt2 = self.optimizers() and call self.manual_backward(loss), "
            "opt.step() and opt.zero_grad().")
    if not manual:
        return
    if not strategy.manual_optimization:
        raise ConfigurationError(
            f"The {strategy.name!r} strategy cannot run manual optimization (it steps its own way: in backward, or "
            f"stage by stage). Use one of {MANUAL_STRATEGIES}.")
    if accumulate != 1:
        raise ConfigurationError(
            f"accumulate_grad_batches={accumulate} does not apply under manual optimization: accumulate in "
            "training_step (call opt.step() and opt.zero_grad() every N batches), as in Lightning.")
    if clip is not None:
        raise ConfigurationError(
            f"gradient_clip_val={clip} does not apply under manual optimization: call "
            "self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm=...) before opt.step(), as in "
            "Lightning.")

