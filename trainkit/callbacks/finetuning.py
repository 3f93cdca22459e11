"""BaseFinetuning: freeze part of a model before training and unfreeze it at an epoch of your choosing, as Lightning's
callback of that name does (the same hooks and static helpers, so a Lightning subclass runs unchanged).

A frozen part is left out of the optimizer (``configure_optimizers`` sees ``requires_grad=False``); unfreezing adds
its parameters to the optimizer as a new param group (``unfreeze_and_add_param_group``). The strategy records the
group when it appears, saves it in checkpoints with the others, and re-creates it on resume before the optimizer
state loads (``single`` and ``ddp``; the sharded strategies refuse at ``on_fit_start``, since they plan their shards
by the groups they were set up with). This callback's own state is what the optimizer's groups do not say: which
parameters train and which BatchNorm layers track running statistics when the checkpoint is written; a resumed run
restores both before training goes on, so it continues as the uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from trainkit.callbacks.base import Callback
from trainkit_strategies.errors import groups_fixed

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer

Modules = nn.Module | Iterable[nn.Module | Iterable]  # a module, or (nested) iterables of modules


class BaseFinetuning(Callback):
    """Override ``freeze_before_training`` (called in ``setup``, before ``configure_optimizers``) to freeze modules,
    and ``finetune_function`` (called at every training epoch's start, once per optimizer) to unfreeze them, usually
    with ``unfreeze_and_add_param_group``. Build the optimizer over the trainable parameters only
    (``filter(lambda p: p.requires_grad, self.parameters())``): a parameter already in the optimizer is not added
    again."""

    _module: nn.Module | None = None  # class defaults too: a subclass may not call super().__init__()
    _restored: dict[str, Any] | None = None  # the checkpoint's state, until on_fit_start puts it back

    def __init__(self) -> None:
        self._module, self._restored = None, None

    # -- the hooks a subclass writes -----------------------------------------------------------------
    def freeze_before_training(self, pl_module: TrainModule) -> None:
        """Freeze what should not train at first (``self.freeze(pl_module.feature_extractor)``, say)."""
        raise NotImplementedError

    def finetune_function(self, pl_module: TrainModule, epoch: int, optimizer: Optimizer) -> None:
        """Unfreeze at the epoch you choose (``if epoch == k: self.unfreeze_and_add_param_group(modules,
        optimizer)``)."""
        raise NotImplementedError

    # -- Callback ------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._module = module
        self.freeze_before_training(module)

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        strategy = trainer.strategy
        if not strategy.accepts_new_groups:
            raise groups_fixed(strategy.name, f"{type(self).__name__} (a BaseFinetuning) unfreezes parameters and "
                                              "adds them to the optimizer during training")
        if self._restored is not None:  # after the checkpoint: its optimizer re-created the added groups
            trainable, tracking = set(self._restored["trainable"]), set(self._restored["tracking"])
            for name, p in module.named_parameters():
                p.requires_grad_(name in trainable)
            for name, m in module.named_modules():
                if isinstance(m, _BatchNorm):
                    m.track_running_stats = name in tracking
            self._restored = None

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        for optimizer in trainer.optimizers:
            self.finetune_function(module, trainer.current_epoch, optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Which parameters train and which BatchNorm layers track statistics now, by name (the param groups
        themselves are in the checkpoint's optimizer state)."""
        if self._module is None:
            return {}
        return {"trainable": [n for n, p in self._module.named_parameters() if p.requires_grad],
                "tracking": [n for n, m in self._module.named_modules()
                             if isinstance(m, _BatchNorm) and m.track_running_stats]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Kept until ``on_fit_start``: ``freeze_before_training`` has frozen the model again by then."""
        self._restored = state if state else None

    # -- helpers (Lightning's static methods) ---------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of ``modules`` (a module, or nested iterables of them), and those holding parameters of
        their own."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            found: Iterable[nn.Module] = [m for inner in modules for m in BaseFinetuning.flatten_modules(inner)]
        else:
            found = modules.modules()
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad``; BatchNorm's only with
        ``train_bn``."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for param in mod.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze every parameter of ``modules``; BatchNorm layers track running statistics again."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm):
                mod.track_running_stats = True
            for param in mod.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze ``module``'s own parameters; a BatchNorm layer stops tracking running statistics (in training mode
        it normalises by each batch's statistics, in evaluation by the statistics it had)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable (and tracking)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` less those the optimizer holds already (warning when there are some). By identity: Lightning
        compares values (``torch.equal``), which also drops a parameter equal to another, two zero biases say."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        kept = [p for p in params if id(p) not in held]
        if len(kept) < len(params):
            rank_zero_warn(f"{len(params) - len(kept)} of the parameters to unfreeze are in the optimizer already and "
                           "are not added again. Build the optimizer over the trainable parameters only: "
                           f"{type(optimizer).__name__}(filter(lambda p: p.requires_grad, self.parameters()), ...).")
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: Optimizer, lr: float | None = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as one new param group, at ``lr`` (default:
        the first group's learning rate divided by ``initial_denom_lr``); BatchNorm's only with ``train_bn``."""
        BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})
