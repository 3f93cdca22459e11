"""Trainer: runs fit / validate / test / predict for a TrainModule through a Strategy."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from trainkit import arguments, launcher, resume, rundir, transforms
from trainkit.auto import choose_strategy
from trainkit.callbacks.base import Callback
from trainkit.callbacks.profiler import SimpleProfiler
from trainkit.callbacks.progress import ProgressBar
from trainkit.callbacks.timer import Timer
from trainkit.data import DataConnector, DataModule, EvalLoaders
from trainkit.dispatch import HookDispatch
from trainkit.estimate import parse_bytes
from trainkit.evaluation import EvalLoop
from trainkit.failures import leave_the_ranks
from trainkit.loggers import Logger
from trainkit.loggers.base import finalize_all
from trainkit.loops import FitLoop, LoopConfig, Progress, loss_logger
from trainkit.manual import ManualStep, check_manual, owners_by_name, strategy_optimizer
from trainkit.module import TrainModule
from trainkit.optim import OptimizerConfig, parse_optimizers
from trainkit.properties import TrainerProperties
from trainkit.results import Results
from trainkit.saving import Saving
from trainkit.seed import seed_everything
from trainkit.step import OptimizerStep, StepConfig
from trainkit.utils import model_summary, print_results, tensor_cores_idle
from trainkit.work import show_progress
from trainkit_strategies import Precision, Strategy
from trainkit_strategies.registry import get_strategy


class Trainer(TrainerProperties):
    """Runs a TrainModule.

    Args:
        accelerator: "cpu", "cuda", "gpu" (Lightning's name: CUDA, an error where there is none) or "auto".
        strategy: a registered name ("single", "ddp", "zero1", ...), a Strategy instance with its options, or
            "auto": single on one process; on several, the fastest of ddp, zero1, zero2, fsdp, zero_offload whose
            planned memory (``trainkit estimate``) fits ``device_memory``, chosen when fit starts.
        devices: processes on this machine; above 1 trainkit launches them (or detects torchrun/SLURM). "auto" or -1:
            every visible GPU under CUDA, 1 on the CPU (one device); GPU indices ``[0, ..., n-1]`` are ``n``.
        num_nodes: machines in the run (set by torchrun/SLURM).
        precision: "32", "bf16-mixed", "16-mixed" or "bf16-true".
        reduce_dtype: dtype gradients are summed across ranks in ("fp32", "bf16", "fp16"); None: their own dtype.
        max_epochs: stop after this many epochs (default 1000 when max_steps is not set either).
        min_epochs: train at least this many epochs: until then (and min_steps), ``should_stop`` (EarlyStopping's,
            max_time's) waits.
        min_steps: train at least this many optimizer steps: until then (and min_epochs), ``should_stop`` waits.
        max_steps: stop after this many optimizer steps (-1: no limit).
        max_time: stop at the first optimizer-step boundary after this much training time ("DD:HH:MM:SS", a
            timedelta or a dict such as ``{"hours": 1}``), every rank at the same step; the time spent survives a
            resume (the ``Timer`` callback's state). Without max_epochs or max_steps it is the only limit.
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches: an int
            (batches) or a float fraction of each epoch.
        overfit_batches: train and validate on this many (int) or this fraction (float) of the training and of the
            validation batches, the same ones, in order (shuffling off), every epoch; 0 turns it off.
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
        activation_checkpointing: recompute activations in backward instead of storing them: ``"full"`` (the
            model's repeated blocks, whole forward again), ``"selective"`` (the repeated blocks, keeping matmul and
            attention outputs and recomputing the cheap rest: norms, activation functions, softmax), or module
            classes (or a ``module -> bool`` policy) recomputed in full.
        activation_checkpointing_every: checkpoint one selected module in this many (1: all of them).
        compile: ``torch.compile`` each of the model's repeated blocks on its own (the whole forward where it has
            none), after tensor parallelism and activation checkpointing and before the strategy's engine
            (``transforms.py``), so it composes with every strategy.
        deterministic: use deterministic algorithms only.
        benchmark: set ``torch.backends.cudnn.benchmark``; None keeps torch's setting (False under deterministic).
        inference_mode: ``validate``/``test``/``predict`` run under ``torch.inference_mode`` (False: ``torch.no_grad``,
            as validation during fit always does, and every loop over gloo or a sharding strategy, as in Lightning).
        sync_batchnorm: BatchNorm layers normalise over the global batch, as one process on it would: their statistics
            are summed over the data-parallel ranks (``trainkit_strategies/data_parallel/sync_batchnorm.py``).
        reload_dataloaders_every_n_epochs: build the training and validation loaders again from the module or
            DataModule every N epochs (at epochs N, 2N, ...; a resumed fit builds them for the epoch it resumes in);
            0: never.
        seed: seed python, numpy and torch at the start of each run (also the sampler seed).
        callbacks: extra callbacks.
        logger: True for TensorBoard under ``<default_root_dir>/runs``, False for none, or loggers.
        enable_checkpointing: add a default ModelCheckpoint when none is given.
        enable_progress_bar: show a progress bar on rank 0.
        enable_model_summary: print the module's top-level layers and parameter counts when fit starts.
        enable_telemetry: log ``comm/``, ``time/`` and ``memory/`` scalars (``Telemetry``) and ``throughput/``
            ones (``ThroughputMonitor``: samples/s, model TFLOP/s, MFU) with the metrics; only with a logger.
        profiler: "pytorch" (torch.profiler trace of a few steps under the log directory), "simple" (a table of
            hook and step times when fit ends) or None.
        use_distributed_sampler: replace a DataLoader's default sampler by trainkit's (sharded by rank,
            resumable mid-epoch, one global order at any world size); off uses loaders exactly as given.
        default_root_dir: where runs/ and checkpoints/ go.
        timeout_s: seconds a collective waits for a peer before the run fails.
        peer_timeout_s: seconds a peer may stop answering the heartbeat before the run fails (a rank that died,
            was killed or froze; NCCL does not notice one by itself); 0 turns the heartbeat off.
        device_memory: memory of one device that ``strategy="auto"`` plans against, in bytes or as "80GB"
            (default: the GPU's total memory; on the CPU, the machine's memory divided among its ranks).
        on_nonfinite: what a NaN or infinite loss or gradient norm on any rank does: "stop" ends the run with an error
            naming the step (no checkpoint is written from it; the last one stays ``latest``); "skip" skips that
            optimizer step (every rank alike; one host synchronisation per step, to read the norm) and stops after
            ``max_nonfinite_skips`` in a row.
        max_nonfinite_skips: under ``on_nonfinite="skip"``, optimizer steps in a row that may be skipped.
        float32_matmul_precision: "highest", "high" or "medium": ``torch.set_float32_matmul_precision`` for the run.
            "high" lets fp32 matrix products use TF32 tensor cores (Ampere and newer GPUs; about 7x the plain fp32
            rate on an H100, with a 10-bit mantissa for the products' inputs). None leaves torch's setting, and on
            such a GPU running fp32 says once that the tensor cores sit idle.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: Strategy | str = "auto",
        devices: int | str | list[int] = 1,
        num_nodes: int = 1,
        precision: str = "32",
        reduce_dtype: str | None = None,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 2,
        fast_dev_run: bool | int = False,
        log_every_n_steps: int = 50,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        activation_checkpointing: Literal["full", "selective"] | list[type[nn.Module]] | Callable[[nn.Module], bool]
        | None = None,
        activation_checkpointing_every: int = 1,
        compile: bool = False,
        deterministic: bool = False,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        seed: int | None = None,
        callbacks: list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        enable_telemetry: bool = True,
        profiler: str | None = None,
        use_distributed_sampler: bool = True,
        default_root_dir: str | Path = ".",
        timeout_s: float = 1800.0,
        peer_timeout_s: float = 15.0,
        device_memory: str | int | None = None,
        float32_matmul_precision: str | None = None,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        max_nonfinite_skips: int = 10,
    ) -> None:
        arguments.check(locals())  # every argument, before any rank starts
        arguments.set_backends(benchmark, deterministic, float32_matmul_precision)
        accelerator = arguments.resolve_accelerator(accelerator)
        devices = arguments.resolve_devices(devices, accelerator)
        self.max_time = arguments.parse_max_time(max_time)
        self.precision = Precision.from_name(precision, reduce_dtype=reduce_dtype)
        self.device_memory = parse_bytes(device_memory) if device_memory is not None else None
        self._auto = False  # strategy="auto" on several ranks: the plan is chosen when fit starts
        self.default_root_dir = Path(default_root_dir)
        self.devices, self.num_nodes, self.accelerator, self.timeout_s = devices, num_nodes, accelerator, timeout_s
        self.env = launcher.connect(accelerator, devices, num_nodes, timeout_s, peer_timeout_s)
        self.strategy = self._resolve_strategy(strategy)
        if self.precision.name == "32" and tensor_cores_idle(self.strategy.device):
            rank_zero_warn(f"fp32 matrix products run without the tensor cores of {torch.cuda.get_device_name()}: pass "
                           "float32_matmul_precision='high' (--trainer.float32_matmul_precision high) to run them in "
                           "TF32, or use precision='bf16-mixed'.")
        self.saving = Saving(self.strategy, on_nonfinite, max_nonfinite_skips)  # checks and writes checkpoints
        launcher.joined()

        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:
            n = self.fast_dev_run
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            max_steps, max_epochs, num_sanity_val_steps, val_check_interval = n, 1, 0, None
            logger, enable_checkpointing = False, False
        if overfit_batches:  # Lightning's: that much of the training and validation data, in order, every epoch
            limit_train_batches = limit_val_batches = overfit_batches
        if max_epochs is None and max_steps == -1 and self.max_time is None:
            max_epochs = 1000
        self.max_epochs, self.max_steps, self.min_epochs, self.min_steps = max_epochs, max_steps, min_epochs, min_steps
        self.overfit_batches, self.inference_mode, self.sync_batchnorm = overfit_batches, inference_mode, sync_batchnorm
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.limit_train_batches, self.limit_val_batches = limit_train_batches, limit_val_batches
        self.limit_test_batches, self.limit_predict_batches = limit_test_batches, limit_predict_batches
        self.val_check_interval, self.check_val_every_n_epoch = val_check_interval, check_val_every_n_epoch
        self.num_sanity_val_steps, self.log_every_n_steps = num_sanity_val_steps, log_every_n_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.activation_checkpointing = activation_checkpointing
        self.activation_checkpointing_every, self.compile = activation_checkpointing_every, compile
        self.enable_model_summary = enable_model_summary and not self.fast_dev_run
        self.use_distributed_sampler = use_distributed_sampler
        self.deterministic, self.seed = deterministic, seed

        self.loggers: list[Logger] = arguments.resolve_loggers(logger, self.default_root_dir)
        self.callbacks, self.profiler = arguments.callbacks(callbacks, enable_checkpointing, enable_progress_bar,
                                                            enable_telemetry and bool(self.loggers), profiler,
                                                            self.max_time)

        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self.optimizer_config: OptimizerConfig | None = None
        self.state = "idle"  # "fit", "validate", "test" or "predict" while one runs
        self.progress = Progress()
        # both ask for the strategy when they use it: strategy="auto" decides it when fit starts
        self.results = Results(lambda t, op: self.strategy.reduce(t, op),  # what ``self.log`` records
                               lambda t, op: self.strategy.reduce_tokens(t, op))
        self.data = DataConnector(lambda: self.strategy, self.precision, use_distributed_sampler, seed or 0,
                                  overfit=bool(overfit_batches))
        self.fit_loop: FitLoop | None = None  # the loops of the current (or last) run
        self._hooks: HookDispatch | None = None  # the current run's
        self.evaluation: EvalLoop | None = None
        self._logged_metrics: dict[str, float] = {}
        self._owners: dict[str, int] = {}  # each trained parameter's optimizer (``manual.owners_by_name``)
        self._claims: list[rundir.Claim] = []  # rank 0's hold on the fit's checkpoint directories

    # -- construction helpers ---------------------------------------------------------------------
    def _resolve_strategy(self, strategy: str | Strategy) -> Strategy:
        if isinstance(strategy, str):
            if strategy == "auto":
                self._auto = self.env.world_size > 1
                strategy = "ddp" if self._auto else "single"  # ddp joins the ranks until fit picks the plan
            strategy = get_strategy(strategy)
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a name or a Strategy; got {type(strategy).__name__}.")
        strategy.setup_environment(self.env)
        rank_zero_only.rank = self.env.rank
        return strategy

    # -- public state: more in TrainerProperties --------------------------------------------------
    def to_device(self, batch: Any) -> Any:
        """Move ``batch`` to this rank's device and apply the precision policy's input cast."""
        return self.data.to_device(batch)

    # -- entry points -----------------------------------------------------------------------------
    def fit(
        self,
        model: TrainModule,
        train_dataloaders: DataLoader | DataModule | None = None,
        val_dataloaders: DataLoader | Sequence[DataLoader] | None = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train ``model``; ``ckpt_path`` (a checkpoint, or "last") resumes a run exactly where it stopped."""
        self._run("fit", model, datamodule, ckpt_path, train=train_dataloaders, evaluation=val_dataloaders)

    def validate(
        self, model: TrainModule | None = None, dataloaders: EvalLoaders = None,
        datamodule: DataModule | None = None, ckpt_path: str | Path | None = None, verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the validation loop once (``model=None``: the last run's module); ``verbose`` prints the results."""
        return self._run("validate", model, datamodule, ckpt_path, evaluation=dataloaders, verbose=verbose)

    def test(
        self, model: TrainModule | None = None, dataloaders: EvalLoaders = None,
        datamodule: DataModule | None = None, ckpt_path: str | Path | None = None, verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the test loop once (``model=None``: the last run's module); ``verbose`` prints the results."""
        return self._run("test", model, datamodule, ckpt_path, evaluation=dataloaders, verbose=verbose)

    def predict(
        self, model: TrainModule | None = None, dataloaders: EvalLoaders = None,
        datamodule: DataModule | None = None, ckpt_path: str | Path | None = None,
    ) -> list[Any]:
        """Every ``predict_step`` output, in order (``model=None``: the last run's module)."""
        return self._run("predict", model, datamodule, ckpt_path, evaluation=dataloaders)

    def save_checkpoint(self, dirpath: str | Path, name: str, update_latest: bool = True, async_save: bool = False,
                        on_commit: Callable[[Path], None] | None = None) -> Path:
        """Write a universal checkpoint ``dirpath/name`` (collective: every rank calls it). With ``async_save``
        the state is copied to host memory now and written in the background; the checkpoint (and ``latest``)
        appears once every rank's file is durable, at a later step boundary, and ``on_commit(path)`` runs then.
        A save waits for the one before it."""
        assert self.module is not None and self._hooks is not None, "save_checkpoint runs during fit"
        module, hooks = self.module, self._hooks
        return self.saving.save(self.strategy, lambda: resume.checkpoint_meta(
            self._states(), module, self.strategy, self.precision.name, lambda user: hooks("on_save_checkpoint", user)),
            dirpath, name, update_latest, async_save, on_commit)

    def _at_boundary(self, time_up: bool) -> bool:
        return self.saving.at_boundary(self.strategy, self.global_step, self._save_preempted, time_up)

    def _save_preempted(self) -> Path:
        callback = self.checkpoint_callback
        return callback.save(self, wait=True) if callback else \
            self.save_checkpoint(self.checkpoint_dir, f"preempted-step={self.global_step}")

    def resolve_ckpt_path(self, ckpt_path: str | Path) -> Path | None:
        """The checkpoint ``ckpt_path`` ("last", "best", a checkpoint, or a directory with ``latest``) names."""
        callback = self.checkpoint_callback
        base = callback.base_dirpath if callback is not None and callback.base_dirpath is not None else None
        return resume.resolve(base or self.checkpoint_dir, ckpt_path, callback)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send metrics to every logger (rank 0 only); for callbacks."""
        self._logged_metrics.update(metrics)
        if self.is_global_zero and metrics:
            for lg in self.loggers:
                lg.log_metrics(metrics, self.global_step if step is None else step)

    def _emit(self, metrics: dict[str, float]) -> None:
        """The loops' logging: ``metrics`` at the current step, then the loggers flushed."""
        if metrics:
            self.log_metrics(metrics, self.global_step)
            if self.is_global_zero:
                for lg in self.loggers:
                    lg.save()

    # -- the run ----------------------------------------------------------------------------------
    def _loop_config(self) -> LoopConfig:
        return LoopConfig(self.max_epochs, self.max_steps, self.limit_train_batches, self.limit_val_batches,
                          self.val_check_interval, self.check_val_every_n_epoch, self.num_sanity_val_steps,
                          self.log_every_n_steps, self.seed or 0, self.min_epochs, self.min_steps,
                          self.reload_dataloaders_every_n_epochs, self.inference_mode)

    def _run(self, fn: str, model: TrainModule | None, datamodule: DataModule | None, ckpt_path: str | Path | None,
             train: Any = None, evaluation: Any = None, verbose: bool = False) -> Any:
        module, ckpt_path = arguments.run_module(fn, model, self.module, ckpt_path)
        train, evaluation, datamodule = arguments.split_datamodule(fn, train, evaluation, datamodule)
        self.state, self.module, self.datamodule = fn, module, datamodule
        self.should_stop = False
        module._trainer = self
        if self.seed is not None:
            seed_everything(self.seed)
        if self.deterministic:
            torch.use_deterministic_algorithms(True)
        timer = self.profiler if isinstance(self.profiler, SimpleProfiler) else None
        hooks = self._hooks = HookDispatch(self, module, self.callbacks, timer)
        show_progress(any(isinstance(c, ProgressBar) for c in self.callbacks) and self.is_global_zero)  # long work
        self.data.prepare(datamodule if datamodule is not None else module, train)
        try:
            self._setup(fn, module, hooks)
            self.data.connect(fn, evaluation)
            config = self._loop_config()
            self.evaluation = EvalLoop(config, self.strategy, hooks, self.results, self.data, self._emit,
                                       self.log_metrics)
            if fn == "fit":
                guard = self.saving.begin_fit(self.strategy, self.log_every_n_steps, lambda: self.checkpoint_dir)
                step = ManualStep(self.strategy, self.precision, hooks, self.optimizer_config, module, self._owners,
                                  guard) if not module.automatic_optimization else OptimizerStep(
                    self.strategy, StepConfig(self.accumulate_grad_batches, self.gradient_clip_val,
                                              self.gradient_clip_algorithm), self.precision, hooks,
                    self.optimizer_config, loss_logger(self.results), equal_batches=self.data.equal_batches,
                    guard=guard)
                self.fit_loop = FitLoop(config, self.progress, module, self.strategy, step, hooks, self.results,
                                        self.data, self.evaluation, self._emit, self._at_boundary,
                                        next((c for c in self.callbacks if isinstance(c, Timer)), None))
            path = self.resolve_ckpt_path(ckpt_path) if ckpt_path is not None else None
            if fn == "fit":
                self._claims = rundir.claim(self.callbacks, path, self.strategy)
            if path is not None:
                fitting = fn == "fit"
                on_load = hooks if fitting else hooks.module  # a resumed fit's callbacks get their state back too
                random_state = resume.restore(path, module, self.strategy, self._states() if fitting else None,
                                              lambda user: on_load("on_load_checkpoint", user), self.world_size,
                                              self.global_rank)
                if self.fit_loop is not None and fitting:
                    self.fit_loop.pending_rng = random_state
                if self.is_global_zero:
                    print(resume.report_restored(path, self.progress, self.fit_loop if fitting else None), flush=True)
            if fn == "fit":
                assert self.fit_loop is not None
                self._log_hyperparams()
                self.saving.signals.install(lambda: resume.resume_hint(self.checkpoint_dir))
                self.fit_loop.run()
                self.saving.saver.finish(self.strategy)  # the last asynchronous checkpoint is committed as fit returns
                return None
            if fn == "predict":
                return self.evaluation.predict(module, self.data.val_dataloaders, self.limit_predict_batches)
            limit = self.limit_val_batches if fn == "validate" else self.limit_test_batches
            metrics = self.evaluation.run(module, fn, self.data.val_dataloaders, limit)
            if verbose:
                print_results(fn, metrics, self.is_global_zero)
            return [metrics]
        except BaseException as exc:
            for cb in self.callbacks:
                try:
                    cb.on_exception(self, module, exc)
                except Exception as cb_exc:  # keep the original error in front of the user
                    rank_zero_warn(f"{type(cb).__name__}.on_exception failed: {cb_exc!r}")
            failure = leave_the_ranks(exc, self.strategy.comm, self.world_size, self.checkpoint_dir)
            if failure is not None:
                raise failure from exc
            raise
        finally:
            failing = sys.exc_info()[0] is not None
            if self.fit_loop is not None:  # what its step hooked into the module comes off, however the run ends
                self.fit_loop.step.release()
            self.saving.signals.uninstall(clean=not failing)
            hooks("teardown", fn)
            if self.datamodule is not None:
                self.datamodule.teardown(fn)
            try:  # the strategy's threads stop and its gradient hooks come off; its next backward puts them back
                self.strategy.teardown()
            except Exception as err:
                if not failing:
                    raise
                rank_zero_warn(f"{type(self.strategy).__name__}.teardown failed after the run's error: {err!r}")
            if self.is_global_zero:
                finalize_all(self.loggers, failing)
            for claim in self._claims:
                claim.release()
            self._claims = []
            self.state = "idle"

    def _setup(self, fn: str, module: TrainModule, hooks: HookDispatch) -> None:
        if self.datamodule is not None and self.is_global_zero:
            self.datamodule.prepare_data()
        self.strategy.barrier()
        if self.datamodule is not None:
            self.datamodule.setup(fn)
        hooks("setup", fn)
        if self._auto and fn == "fit":
            self._choose_strategy(module)
        needs_optimizer = fn == "fit" and self.strategy.optimizer is None
        if self.strategy.module is module and not needs_optimizer:
            return
        if self.strategy.module is not module:
            transforms.build(module, self.strategy, self.activation_checkpointing, self.activation_checkpointing_every,
                             self.compile, self.sync_batchnorm)
        optimizer = None
        if fn == "fit":
            if self.enable_model_summary and self.is_global_zero:
                print(model_summary(module))
            config = self.optimizer_config = parse_optimizers(module.configure_optimizers())
            check_manual(self.strategy, config, not module.automatic_optimization, self.accumulate_grad_batches,
                         self.gradient_clip_val)
            self._owners, optimizer = owners_by_name(config, module), strategy_optimizer(config)
        self.strategy.setup(module, optimizer, self.precision)

    def _states(self) -> dict[str, Any]:
        """What a checkpoint keeps besides tensors, by its key in meta.json (``resume.py``)."""
        schedulers = self.optimizer_config if self.lr_scheduler is not None else None
        return {"loop": self.fit_loop, "scheduler": schedulers, "scaler": self.scaler,
                "callbacks": {cb.state_key: cb for cb in self.callbacks}, "datamodule": self.datamodule,
                "run": resume.RunShape(self.data, self.accumulate_grad_batches)}

    def _choose_strategy(self, module: TrainModule) -> None:
        """``strategy="auto"``: rank 0's plan (``auto.py``), and the chosen strategy in the planner's place."""
        self._auto = False
        self.strategy = choose_strategy(module, self.data.source_train(), self.strategy, self.env,
                                        self.precision.name, self.device_memory, self.activation_checkpointing,
                                        self.activation_checkpointing_every)

    def _log_hyperparams(self) -> None:
        if not self.is_global_zero:
            return
        params = {"model": dict(self.module.hparams)} if self.module is not None else {}
        params["trainer"] = {"strategy": self.strategy.name, "precision": self.precision.name,
                             "world_size": self.world_size, "accumulate_grad_batches": self.accumulate_grad_batches,
                             "max_steps": self.max_steps, "max_epochs": self.max_epochs, "seed": self.seed}
        for lg in self.loggers:
            lg.log_hyperparams(params)
