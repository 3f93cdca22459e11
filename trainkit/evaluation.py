"""The evaluation loop: validation, test and prediction, with what ``self.log`` records in them.

Built per run, like the training loop (``loops.py``), with what it uses; it never touches the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainkit.data import DataConnector, num_batches
from trainkit.dispatch import HookDispatch
from trainkit.errors import MissingStep
from trainkit.loops import Emit, LoopConfig, _iterate, steps_cap
from trainkit.module import TrainModule
from trainkit.results import Results
from trainkit.utils import takes_batch_idx
from trainkit_strategies import RunsSchedule, ShardedInit, Strategy, capability
from trainkit_strategies.communication.liveness import activity


class EvalLoop:
    """Validation, test and prediction: no gradients, module in eval mode, per-epoch aggregates.

    Values logged ``on_step`` reach the loggers after each batch (not in the sanity check), as ``<name>_step`` when
    also ``on_epoch`` (else ``<name>``), at a step that counts each dataloader's evaluation batches over the run
    (Lightning's x-axis for them); their epoch aggregate follows as ``<name>_epoch``. A per-batch value is this
    rank's own (over a context-parallel group's chunks): ``sync_dist`` reduces the epoch value, since ranks may hold
    different numbers of evaluation batches and a collective per batch would wait forever for the shorter ones.
    """

    def __init__(self, config: LoopConfig, strategy: Strategy, hooks: HookDispatch, results: Results,
                 data: DataConnector, emit: Emit, log_step: Callable[[dict[str, float], int], None] = lambda m, s: None
                 ) -> None:
        self.config, self.strategy, self.hooks, self.results, self.data, self.emit = (
            config, strategy, hooks, results, data, emit)
        self.log_step = log_step  # per-batch values to the loggers, at a step of their own
        self.sanity_checking = False  # True while the sanity validation before training runs
        self._schedule = capability(strategy, RunsSchedule)
        self._evaluate = self._step if self._schedule is None else self._scheduled
        self._with_idx = True  # the step method takes batch_idx (asked when each loop starts)
        self._seen: dict[int | None, int] = {}  # evaluation batches per dataloader: the per-batch values' step

    def _no_grad(self, fitting: bool) -> AbstractContextManager:
        """``torch.inference_mode`` where Lightning uses it: validate/test/predict on their own with
        ``inference_mode=True``; ``torch.no_grad`` for validation during fit (the model trains on), over gloo, and
        under a strategy that shards parameters or runs a schedule (buffers it makes in inference mode could not be
        written in training: pytorch#95957, why Lightning leaves it off for FSDP)."""
        strategy = self.strategy
        if (not self.config.inference_mode or fitting or (strategy.world_size > 1 and strategy.device.type == "cpu")
                or capability(strategy, ShardedInit) is not None or self._schedule is not None):
            return torch.no_grad()
        return torch.inference_mode()

    def _batches(self, loaders: Sequence[DataLoader], limit: int | float | None, phase: str
                 ) -> Iterator[tuple[int, int, Any]]:
        moves = self.data.moves_batches
        cap = steps_cap()
        for dl_idx, loader in enumerate(loaders):
            n = num_batches(loader, limit) if cap is None else min(num_batches(loader, limit), cap)
            activity.enter(phase)
            for batch_idx, batch in enumerate(_iterate(loader, 0, self.config.seed, 0)):
                if batch_idx >= n:
                    break
                yield dl_idx, batch_idx, self.data.to_device(batch) if moves else batch
                activity.enter(phase)

    def run(self, module: nn.Module, fn: str, loaders: Sequence[DataLoader], limit: int | float | None,
            sanity: bool = False, fitting: bool = False) -> dict[str, float]:
        """Evaluate ``module`` for ``fn`` ("validate" or "test") over ``loaders``; returns the epoch metrics.
        ``fitting``: a validation during fit (``torch.no_grad``, whatever ``inference_mode`` says)."""
        prefix = "validation" if fn == "validate" else "test"
        step = "validation_step" if fn == "validate" else "test_step"
        if self._schedule is None and getattr(type(module), step) is getattr(TrainModule, step):
            raise MissingStep(f"Trainer.{fn} runs {type(module).__name__}.{step}(batch, batch_idx), which it does not "
                              f"define: add one (log what it measures with self.log), as Lightning requires.")
        self.strategy.settle()  # evaluate the parameters of every step taken
        outside, label = activity.now, f"{type(module).__name__}.{step}"  # the phase to return to, and this loop's
        was_training = module.training
        module.eval()
        results = self.results
        results.loop = fn
        results.reset(fn)
        self.sanity_checking = sanity
        if not sanity:
            self.hooks(f"on_{prefix}_start")
            self.hooks(f"on_{prefix}_epoch_start")
        batch_end = self.hooks.fns(f"on_{prefix}_batch_end") if not sanity else []
        multi = len(loaders) > 1
        self._with_idx = takes_batch_idx(getattr(module, step))
        seen = self._seen
        with self._no_grad(fitting or sanity), self.strategy.forward_context():
            for dl_idx, batch_idx, batch in self._batches(loaders, limit, f"the {prefix} dataloader"):
                activity.enter(label)
                batch = self.strategy.local_batch(batch)  # under context parallelism: this rank's tokens
                results.batch = batch
                out = self._evaluate(module, fn, batch, batch_idx, dl_idx if multi else None)
                for hook in batch_end:
                    hook(out, batch, batch_idx)
                if not sanity:
                    logged = results.fresh_step_metrics()
                    if logged:
                        self.log_step(logged, seen.get(dl_idx, 0))
                    seen[dl_idx] = seen.get(dl_idx, 0) + 1
        if not sanity:
            self.hooks(f"on_{prefix}_epoch_end")
        metrics = results.epoch_metrics()
        if sanity:
            results.reset(fn)
        else:
            self.emit(metrics)
            self.hooks(f"on_{prefix}_end")
        self.sanity_checking = False
        if was_training:
            module.train()
        activity.now = outside
        return metrics

    def _step(self, module: nn.Module, fn: str, batch: Any, batch_idx: int, dl_idx: int | None) -> Any:
        step = module.validation_step if fn == "validate" else module.test_step
        args = (batch, batch_idx) if self._with_idx else (batch,)
        return step(*args) if dl_idx is None else step(*args, dataloader_idx=dl_idx)

    def _scheduled(self, module: nn.Module, fn: str, batch: Any, batch_idx: int, dl_idx: int | None) -> Any:
        """A schedule-running strategy evaluates the batch itself: metrics identical on its ranks, logged by all."""
        assert self._schedule is not None
        metrics = self._schedule.eval_schedule(module, batch, batch_idx, fn)
        for name, value in (metrics or {}).items():
            self.results.log(name, value, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)
        return metrics

    def predict(self, module: nn.Module, loaders: Sequence[DataLoader], limit: int | float | None) -> list[Any]:
        if type(module).predict_step is TrainModule.predict_step and type(module).forward is nn.Module.forward:
            raise MissingStep(f"Trainer.predict runs {type(module).__name__}.predict_step(batch, batch_idx), which "
                              "it does not define, nor forward() that the default one calls: add either.")
        if self._schedule is not None:
            raise ValueError(f"predict is not supported under strategy {self.strategy.name!r}; load the "
                             "checkpoint with strategy 'single' or 'ddp' to predict.")
        module.eval()
        self.results.loop = "predict"
        self.hooks("on_predict_start")
        self.hooks("on_predict_epoch_start")
        outputs = []
        batch_end = self.hooks.fns("on_predict_batch_end")
        label = f"{type(module).__name__}.predict_step"
        with_idx = takes_batch_idx(module.predict_step)
        with self._no_grad(False), self.strategy.forward_context():
            for _, batch_idx, batch in self._batches(loaders, limit, "the predict dataloader"):
                activity.enter(label)
                local = self.strategy.local_batch(batch)
                out = module.predict_step(local, batch_idx) if with_idx else module.predict_step(local)
                for hook in batch_end:
                    hook(out, batch, batch_idx)
                outputs.append(out)
        self.hooks("on_predict_epoch_end")
        self.hooks("on_predict_end")
        activity.now = None
        return outputs
