"""Trainer: runs fit / validate / test / predict for a TrainModule through a Strategy."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from trainkit import checkpoint as ckpt
from trainkit import launcher
from trainkit.activation import apply_activation_checkpointing
from trainkit.callbacks.base import Callback
from trainkit.callbacks.checkpointing import ModelCheckpoint
from trainkit.callbacks.progress import ProgressBar
from trainkit.data import DataModule, num_batches, rebuild_loader
from trainkit.hooks import HOOK_NAMES, ModelHooks
from trainkit.loggers import Logger, TensorBoardLogger
from trainkit.loops import EvalLoop, FitLoop
from trainkit.module import TrainModule
from trainkit.optim import OptimizerConfig, parse_optimizers
from trainkit.results import Results
from trainkit.seed import rng_state, seed_everything, set_rng_state
from trainkit.utils import jsonable, model_summary
from trainkit_strategies import DynamicLossScaler, Precision, RunsSchedule, ShardedInit, Strategy
from trainkit_strategies.comm import PeerError
from trainkit_strategies.registry import get_strategy


class Trainer:
    """Runs a TrainModule.

    Args:
        accelerator: "cpu", "cuda" or "auto".
        strategy: a registered name ("single", "ddp", "zero1", ...), "auto" (single on one process, ddp
            on several), or a Strategy instance with its options.
        devices: processes on this machine; above 1 trainkit launches them (or detects torchrun/SLURM).
        num_nodes: machines in the run (set by torchrun/SLURM).
        precision: "32", "bf16-mixed", "16-mixed" or "bf16-true".
        max_epochs: stop after this many epochs (default 1000 when max_steps is not set either).
        max_steps: stop after this many optimizer steps (-1: no limit).
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches: an int
            (batches) or a float fraction of each epoch.
        val_check_interval: validate every N training batches (int) or fraction of an epoch (float);
            None validates at the end of every ``check_val_every_n_epoch``-th epoch.
        check_val_every_n_epoch: validate only in every N-th epoch; None lets an int
            ``val_check_interval`` count batches across epochs (iteration-based training).
        num_sanity_val_steps: validation batches run before training to catch bugs early (-1: all).
        fast_dev_run: run N (True: 1) batches of every stage, without logging or checkpoints.
        log_every_n_steps: how often per-step metrics reach the loggers.
        accumulate_grad_batches: micro-batches per optimizer step.
        gradient_clip_val: clip gradients at this value (None: no clipping).
        gradient_clip_algorithm: "norm" (global norm across all shards) or "value".
        activation_checkpointing: module classes (or a ``module -> bool`` policy) whose forward is
            recomputed in backward instead of storing activations.
        deterministic: use deterministic algorithms only.
        seed: seed python, numpy and torch at the start of each run (also the sampler seed).
        callbacks: extra callbacks.
        logger: True for TensorBoard under ``<default_root_dir>/runs``, False for none, or loggers.
        enable_checkpointing: add a default ModelCheckpoint when none is given.
        enable_progress_bar: show a progress bar on rank 0.
        enable_model_summary: print the module's top-level layers and parameter counts when fit starts.
        use_distributed_sampler: replace a DataLoader's default sampler by trainkit's (sharded by rank,
            resumable mid-epoch, one global order at any world size); off uses loaders exactly as given.
        default_root_dir: where runs/ and checkpoints/ go.
        timeout_s: seconds a collective waits for a peer before the run fails.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: Strategy | str = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        precision: str = "32",
        max_epochs: int | None = None,
        max_steps: int = -1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 2,
        fast_dev_run: bool | int = False,
        log_every_n_steps: int = 50,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        activation_checkpointing: list[type[nn.Module]] | Callable[[nn.Module], bool] | None = None,
        deterministic: bool = False,
        seed: int | None = None,
        callbacks: list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        use_distributed_sampler: bool = True,
        default_root_dir: str | Path = ".",
        timeout_s: float = 1800.0,
    ) -> None:
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1; got {accumulate_grad_batches}.")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value'; got {gradient_clip_algorithm!r}.")
        if gradient_clip_val is not None and gradient_clip_val <= 0:
            raise ValueError(f"gradient_clip_val must be positive; got {gradient_clip_val}.")
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1; got {log_every_n_steps}.")
        if devices < 1 or num_nodes < 1:
            raise ValueError(f"devices and num_nodes must be >= 1; got devices={devices}, num_nodes={num_nodes}.")
        if max_steps < -1 or (max_epochs is not None and max_epochs < 0):
            raise ValueError(f"max_steps must be >= -1 and max_epochs >= 0; got {max_steps}, {max_epochs}.")
        self.precision = Precision.from_name(precision)
        self.default_root_dir = Path(default_root_dir)
        self.devices, self.num_nodes, self.accelerator, self.timeout_s = devices, num_nodes, accelerator, timeout_s
        self.env = launcher.connect(accelerator, devices, num_nodes, timeout_s)
        self.strategy = self._resolve_strategy(strategy)
        launcher.joined()

        self.fast_dev_run = int(fast_dev_run)
        if check_val_every_n_epoch is not None and check_val_every_n_epoch < 1:
            raise ValueError(f"check_val_every_n_epoch must be >= 1 or None; got {check_val_every_n_epoch}.")
        if self.fast_dev_run:
            n = self.fast_dev_run
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            max_steps, max_epochs, num_sanity_val_steps, val_check_interval = n, 1, 0, None
            logger, enable_checkpointing = False, False
        if max_epochs is None and max_steps == -1:
            max_epochs = 1000
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.limit_train_batches, self.limit_val_batches = limit_train_batches, limit_val_batches
        self.limit_test_batches, self.limit_predict_batches = limit_test_batches, limit_predict_batches
        self.val_check_interval, self.check_val_every_n_epoch = val_check_interval, check_val_every_n_epoch
        self.num_sanity_val_steps, self.log_every_n_steps = num_sanity_val_steps, log_every_n_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.activation_checkpointing = activation_checkpointing
        self.enable_model_summary = enable_model_summary and not self.fast_dev_run
        self.use_distributed_sampler = use_distributed_sampler
        self.deterministic, self.seed = deterministic, seed

        self.loggers: list[Logger] = self._resolve_loggers(logger)
        self.callbacks: list[Callback] = list(callbacks or [])
        if enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        if enable_progress_bar and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            self.callbacks.append(ProgressBar())
        keys = [c.state_key for c in self.callbacks]
        if len(keys) != len(set(keys)):
            raise ValueError(f"Callbacks need distinct state_key values to be checkpointed; got {keys}.")

        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self.optimizer_config: OptimizerConfig | None = None
        self.scaler: DynamicLossScaler | None = None
        self.fit_loop = FitLoop(self)
        self.eval_loop = EvalLoop(self)
        self._results = Results(self.strategy.reduce)
        self.should_stop = False
        self.state = "idle"
        self.train_dataloader: DataLoader | None = None
        self.val_dataloaders: list[DataLoader] = []
        self._pending_rng: dict | None = None
        self._hooks: dict[str, list[Callable]] = {}
        self._last_loss: torch.Tensor | None = None
        self._logged_metrics: dict[str, float] = {}
        self._train_arg: Any = None
        self.sanity_checking = False  # True while the sanity validation before training runs

    # -- construction helpers ---------------------------------------------------------------------
    def _resolve_strategy(self, strategy: str | Strategy) -> Strategy:
        if isinstance(strategy, str):
            if strategy == "auto":
                strategy = "ddp" if self.env.world_size > 1 else "single"
            strategy = get_strategy(strategy)
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a name or a Strategy; got {type(strategy).__name__}.")
        strategy.setup_environment(self.env)
        rank_zero_only.rank = self.env.rank
        return strategy

    def _resolve_loggers(self, logger: bool | Logger | list[Logger]) -> list[Logger]:
        if logger is True:
            return [TensorBoardLogger(self.default_root_dir / "runs")]
        if logger is False or logger is None:
            return []
        return list(logger) if isinstance(logger, Sequence) else [logger]

    # -- public state -----------------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.fit_loop.global_step

    @property
    def current_epoch(self) -> int:
        return self.fit_loop.epoch

    @property
    def global_rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.strategy.optimizer

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """Latest logged values on this rank (epoch aggregates after each epoch/validation), as 0-d
        tensors like Lightning's."""
        values = self._results.local_values(prog_bar_only=False)
        return {k: torch.tensor(v, device="cpu") for k, v in values.items()}

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        values = self._results.local_values(prog_bar_only=True)
        if self._last_loss is not None:
            values = {"loss": float(self._last_loss), **values}
        return values

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps this ``fit`` will take: ``max_steps``, or the epochs times the batches per
        epoch (after ``limit_train_batches``) divided by the accumulation, whichever is smaller; ``inf``
        when the loader has no length and ``max_steps`` is unset. Usable in ``configure_optimizers``
        (to size a OneCycleLR, say): it fetches the training data early when needed."""
        if self.state != "fit":
            raise RuntimeError("estimated_stepping_batches is known only during fit.")
        if self.train_dataloader is None:
            self._connect_train_data()
        assert self.train_dataloader is not None
        return self.estimated_steps(num_batches(self.train_dataloader, self.limit_train_batches))

    @property
    def num_training_batches(self) -> float:
        """Batches of one training epoch on this rank, after ``limit_train_batches`` (``inf`` if unknown)."""
        if self.train_dataloader is None:
            return 0
        return num_batches(self.train_dataloader, self.limit_train_batches)

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every metric sent to the loggers, as 0-d tensors."""
        return {k: torch.tensor(v, device="cpu") for k, v in self._logged_metrics.items()}

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def log_dir(self) -> Path | None:
        """The first logger's run directory (``runs/<name>/version_N``), or None without a logger."""
        return self.logger.log_dir if self.logger is not None else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.strategy.optimizer] if self.strategy.optimizer is not None else []

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler from ``configure_optimizers``, or None."""
        return self.optimizer_config.scheduler if self.optimizer_config is not None else None

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    @property
    def checkpoint_dir(self) -> Path:
        for cb in self.callbacks:
            if isinstance(cb, ModelCheckpoint):
                return cb.resolve_dirpath(self)
        return self.default_root_dir / "checkpoints"

    # -- entry points -----------------------------------------------------------------------------
    def fit(
        self,
        module: TrainModule,
        train_dataloaders: DataLoader | None = None,
        val_dataloaders: DataLoader | Sequence[DataLoader] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train ``module``. ``ckpt_path`` ("last" or a checkpoint directory) resumes a run exactly."""
        self._run("fit", module, datamodule, ckpt_path, train=train_dataloaders, val=val_dataloaders)

    def validate(
        self, module: TrainModule, dataloaders: DataLoader | Sequence[DataLoader] | None = None,
        datamodule: DataModule | None = None, ckpt_path: str | Path | None = None, verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the validation loop once; ``verbose`` prints the results on rank 0."""
        return self._run("validate", module, datamodule, ckpt_path, val=dataloaders, verbose=verbose)

    def test(
        self, module: TrainModule, dataloaders: DataLoader | Sequence[DataLoader] | None = None,
        datamodule: DataModule | None = None, ckpt_path: str | Path | None = None, verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the test loop once; ``verbose`` prints the results on rank 0."""
        return self._run("test", module, datamodule, ckpt_path, val=dataloaders, verbose=verbose)

    def predict(
        self, module: TrainModule, dataloaders: DataLoader | Sequence[DataLoader] | None = None,
        datamodule: DataModule | None = None, ckpt_path: str | Path | None = None,
    ) -> list[Any]:
        return self._run("predict", module, datamodule, ckpt_path, val=dataloaders)

    def save_checkpoint(self, dirpath: str | Path, name: str, update_latest: bool = True) -> Path:
        """Write a universal checkpoint ``dirpath/name`` (collective: every rank calls it)."""
        meta = self._checkpoint_meta()
        return ckpt.save(dirpath, name, self.strategy, meta, self.strategy.state_pieces(),
                         {"rng": rng_state()}, update_latest)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send metrics to every logger (rank 0 only); for callbacks."""
        self._logged_metrics.update(metrics)
        if self.is_global_zero and metrics:
            for lg in self.loggers:
                lg.log_metrics(metrics, self.global_step if step is None else step)

    # -- the run ----------------------------------------------------------------------------------
    def _run(self, stage: str, module: TrainModule, datamodule: DataModule | None,
             ckpt_path: str | Path | None, train: Any = None, val: Any = None, verbose: bool = False) -> Any:
        if not isinstance(module, TrainModule):
            raise TypeError(f"Trainer.{stage} needs a TrainModule; got {type(module).__name__}.")
        self.state, self.module, self.datamodule = stage, module, datamodule
        self.should_stop = False
        self.train_dataloader, self._train_arg = None, train
        module._trainer = self
        if self.seed is not None:
            seed_everything(self.seed)
        if self.deterministic:
            torch.use_deterministic_algorithms(True)
        self._hooks = self._build_dispatch(module)
        try:
            self._setup(stage, module)
            self._connect_data(stage, train, val)
            if ckpt_path is not None:
                self._restore(ckpt_path, stage)
            if stage == "fit":
                self._log_hyperparams()
                self.fit_loop.run()
                return None
            if stage == "predict":
                if isinstance(self.strategy, RunsSchedule):
                    raise ValueError(f"predict is not supported under strategy {self.strategy.name!r}; load the "
                                     "checkpoint with strategy 'single' or 'ddp' to predict.")
                return self.eval_loop.predict(self.val_dataloaders, self.limit_predict_batches)
            limit = self.limit_val_batches if stage == "validate" else self.limit_test_batches
            metrics = self.eval_loop.run(stage, self.val_dataloaders, limit)
            if verbose:
                self._print_results(stage, metrics)
            return [metrics]
        except BaseException as exc:
            for cb in self.callbacks:
                try:
                    cb.on_exception(self, module, exc)
                except Exception as cb_exc:  # keep the original error in front of the user
                    rank_zero_warn(f"{type(cb).__name__}.on_exception failed: {cb_exc!r}")
            if self.world_size > 1:
                self.strategy.comm.abort()
            if isinstance(exc, PeerError):
                raise PeerError(f"{exc}\n{self._resume_hint()}") from exc
            raise
        finally:
            self._call("teardown", stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage)
            for lg in self.loggers:
                if self.is_global_zero:
                    lg.finalize("finished")
            self.state = "idle"

    def _setup(self, stage: str, module: TrainModule) -> None:
        if self.datamodule is not None and self.is_global_zero:
            self.datamodule.prepare_data()
        self.strategy.barrier()
        if self.datamodule is not None:
            self.datamodule.setup(stage)
        self._call("setup", stage)
        needs_optimizer = stage == "fit" and self.strategy.optimizer is None
        if self.strategy.module is module and not needs_optimizer:
            return
        if self.strategy.module is not module:
            init = self.strategy.init_context() if isinstance(self.strategy, ShardedInit) else nullcontext()
            with init:
                module.configure_model()
            if self.activation_checkpointing:
                apply_activation_checkpointing(module, self.activation_checkpointing)
        optimizer = None
        if stage == "fit":
            if self.enable_model_summary and self.is_global_zero:
                print(model_summary(module))
            self.optimizer_config = parse_optimizers(module.configure_optimizers())
            optimizer = self.optimizer_config.optimizer
            self.scaler = DynamicLossScaler() if self.precision.loss_scaling else None
        self.strategy.setup(module, optimizer, self.precision)

    def _connect_data(self, stage: str, train: Any, val: Any) -> None:
        if stage == "fit" and self.train_dataloader is None:
            self._connect_train_data()
        hook = {"fit": "val_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
                "predict": "predict_dataloader"}[stage]
        loaders = val if val is not None else getattr(self._data_source, hook)()
        if loaders is None:
            loaders = []
        elif isinstance(loaders, DataLoader):
            loaders = [loaders]
        if stage != "fit" and not loaders:
            raise ValueError(f"No {stage} data: pass dataloaders, a datamodule, or implement {hook}() on the module.")
        self.val_dataloaders = [self._rebuild(dl, shuffle=False, pad=False) for dl in loaders]

    def _connect_train_data(self) -> None:
        loader = self._train_arg if self._train_arg is not None else self._data_source.train_dataloader()
        if loader is None:
            raise ValueError(
                "No training data: pass train_dataloaders to fit(), a datamodule, or implement "
                "train_dataloader() on the module."
            )
        self.train_dataloader = self._rebuild(loader, shuffle=None, pad=True)

    @property
    def _data_source(self) -> Any:
        return self.datamodule if self.datamodule is not None else self.module

    def _rebuild(self, loader: Any, shuffle: bool | None, pad: bool) -> Any:
        """``loader`` with trainkit's sampler (``use_distributed_sampler``), sharded by data-parallel rank:
        the stages of one pipeline replica share data."""
        if not self.use_distributed_sampler:
            return loader
        return rebuild_loader(loader, shuffle, self.seed or 0, self.strategy.dp_rank, self.strategy.dp_size, pad=pad)

    def _build_dispatch(self, module: TrainModule) -> dict[str, list[Callable]]:
        """Bound hooks per name, only where a subclass overrides the no-op (the module's first)."""
        table: dict[str, list[Callable]] = {}
        self._module_hooks: dict[str, int] = {}  # how many of a name's hooks are the module's (0 or 1)
        for name in HOOK_NAMES:
            fns: list[Callable] = []
            if getattr(type(module), name) is not getattr(ModelHooks, name):
                fns.append(getattr(module, name))
            self._module_hooks[name] = len(fns)
            for cb in self.callbacks:
                if getattr(type(cb), name) is not getattr(Callback, name):
                    method = getattr(cb, name)
                    fns.append(lambda *a, _m=method: _m(self, module, *a))
            table[name] = fns
        return table

    def _call(self, name: str, *args: Any) -> None:
        for fn in self._hooks[name]:
            fn(*args)

    def _call_module(self, name: str, *args: Any) -> None:
        for fn in self._hooks[name][: self._module_hooks[name]]:
            fn(*args)

    def _call_callbacks(self, name: str, *args: Any) -> None:
        for fn in self._hooks[name][self._module_hooks[name] :]:
            fn(*args)

    def _log_hyperparams(self) -> None:
        if not self.is_global_zero:
            return
        params = {"model": dict(self.module.hparams)} if self.module is not None else {}
        params["trainer"] = {
            "strategy": self.strategy.name, "precision": self.precision.name, "world_size": self.world_size,
            "accumulate_grad_batches": self.accumulate_grad_batches, "max_steps": self.max_steps,
            "max_epochs": self.max_epochs, "seed": self.seed,
        }
        for lg in self.loggers:
            lg.log_hyperparams(params)

    def _print_results(self, stage: str, metrics: dict[str, float]) -> None:
        if not self.is_global_zero or not metrics:
            return
        width = max(len(k) for k in metrics)
        lines = [f"{stage} results"] + [f"  {k:<{width}}  {v:.6g}" for k, v in sorted(metrics.items())]
        print("\n".join(lines))

    # -- checkpoint state ---------------------------------------------------------------------------
    def _checkpoint_meta(self) -> dict[str, Any]:
        assert self.module is not None
        sched = self.optimizer_config.scheduler if self.optimizer_config else None
        meta: dict[str, Any] = {
            "strategy": self.strategy.name,
            "precision": self.precision.name,
            "loop": self.fit_loop.state_dict(),
            "hyperparameters": jsonable(dict(self.module.hparams)),
            "optimizer": {
                "class": type(self.strategy.optimizer).__name__ if self.strategy.optimizer else None,
                "param_groups": self.strategy.optimizer_groups(),
            },
            "scheduler": sched.state_dict() if sched is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "datamodule": self.datamodule.state_dict() if self.datamodule is not None else None,
            "saved_at": time.time(),
        }
        user: dict[str, Any] = {}
        self.module.on_save_checkpoint(user)
        for cb in self.callbacks:
            cb.on_save_checkpoint(self, self.module, user)
        meta["user"] = user
        return meta

    def resolve_ckpt_path(self, ckpt_path: str | Path) -> Path | None:
        if str(ckpt_path) == "last":
            found = ckpt.latest(self.checkpoint_dir)
            if found is None:
                rank_zero_warn(f"ckpt_path='last' but {self.checkpoint_dir} holds no checkpoint; starting fresh.")
            return found
        path = Path(ckpt_path)
        if path.is_dir() and not (path / ckpt.META).exists() and (path / ckpt.LATEST).exists():
            return ckpt.latest(path)
        return path

    def _restore(self, ckpt_path: str | Path, stage: str) -> None:
        path = self.resolve_ckpt_path(ckpt_path)
        if path is None:
            return
        reader = ckpt.CheckpointReader(path)
        meta = reader.meta
        training = stage == "fit"
        self.strategy.load_state(reader, meta["optimizer"]["param_groups"] if training else None)
        self.module.on_load_checkpoint(meta.get("user", {}))
        if not training:
            return
        self.fit_loop.load_state_dict(meta["loop"])
        sched = self.optimizer_config.scheduler if self.optimizer_config else None
        if sched is not None and meta.get("scheduler") is not None:
            sched.load_state_dict(meta["scheduler"])
        if self.scaler is not None and meta.get("scaler") is not None:
            self.scaler.load_state_dict(meta["scaler"])
        for cb in self.callbacks:
            state = meta["callbacks"].get(cb.state_key)
            if state is not None:
                cb.load_state_dict(state)
            cb.on_load_checkpoint(self, self.module, meta.get("user", {}))
        if self.datamodule is not None and meta.get("datamodule") is not None:
            self.datamodule.load_state_dict(meta["datamodule"])
        ranks = meta.get("ranks", [])
        if meta.get("world_size") == self.world_size and len(ranks) == self.world_size:
            self._pending_rng = ranks[self.global_rank]["rng"]
        elif ranks:
            rank_zero_warn(
                f"The checkpoint was saved with {meta.get('world_size')} ranks and this run has {self.world_size}: "
                "random state is re-seeded from rank 0's, so dropout noise will not continue bitwise."
            )
            self._pending_rng = ranks[0]["rng"]

    def _resume_hint(self) -> str:
        try:
            last = ckpt.latest(self.checkpoint_dir)
        except ckpt.CheckpointError:
            last = None
        if last is None:
            return "No checkpoint was committed before the failure."
        return f"The last committed checkpoint, {last}, is intact: resume with --ckpt_path last (or ckpt_path='last')."

    def _apply_pending_rng(self) -> None:
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    # -- numbers used by the loops ------------------------------------------------------------------
    def estimated_steps(self, batches_per_epoch: float) -> float:
        per_epoch = math.ceil(batches_per_epoch / self.accumulate_grad_batches)
        by_epochs = per_epoch * self.max_epochs if self.max_epochs is not None else math.inf
        return min(by_epochs, self.max_steps if self.max_steps >= 0 else math.inf)

    @property
    def _moves_batches(self) -> bool:
        """Whether batches need moving to the device or casting (to bf16 under "bf16-true")."""
        return self.strategy.device.type != "cpu" or self.precision.converts_input

    def to_device(self, batch: Any) -> Any:
        """Move ``batch`` to this rank's device and apply the precision policy's input cast."""
        return self.precision.convert_input(launcher.move_to_device(batch, self.strategy.device))
