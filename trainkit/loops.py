"""The training loop: epochs of micro-batches grouped into optimizer steps (the evaluation loop: ``evaluation.py``).

Loops get what they use when they are built: the loop settings, the strategy, the optimizer step
(``step.py``: accumulation, normalisation, loss scaling, clipping), the hook dispatch, the logged
results, the data and a function that sends metrics to the loggers. What a fit resumes from lives in
``Progress``. Each phase a rank can be stuck in (a dataloader, a step, the optimizer step) is entered in
``liveness.activity``, which the heartbeat carries to the other ranks (the hooks' phases: ``dispatch.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from trainkit.callbacks.timer import Timer
from trainkit.data import DataConnector, ResumableSampler, num_batches
from trainkit.dispatch import HookDispatch
from trainkit.errors import ConfigurationError
from trainkit.module import TrainModule
from trainkit.results import Results
from trainkit.seed import set_rng_state
from trainkit.step import WindowStep
from trainkit.utils import takes_batch_idx
from trainkit_strategies import RunsSchedule, Strategy, capability
from trainkit_strategies.communication.liveness import activity

if TYPE_CHECKING:
    from trainkit.evaluation import EvalLoop

Emit = Callable[[dict[str, float]], None]  # metrics to every logger, at the current global step
STEPS_CAP = "TRAINKIT_MAX_STEPS"


def steps_cap() -> int | None:
    """``TRAINKIT_MAX_STEPS=N``: each fit stops N optimizer steps after where it started (or resumed), and each
    validation, test or predict loop reads at most N batches per loader. For trying a command quickly: the docs
    test runs every documented command so. Unset (or empty): no cap."""
    value = os.environ.get(STEPS_CAP, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigurationError(f"{STEPS_CAP}={value!r}: it caps the steps of every loop and needs a positive "
                                 f"integer; unset it (or set it to, say, 2).")
    return int(value)


@dataclass(frozen=True)
class LoopConfig:
    """The Trainer's loop settings (see ``Trainer`` for each)."""

    max_epochs: int | None = None
    max_steps: int = -1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 50
    seed: int = 0
    min_epochs: int | None = None
    min_steps: int | None = None
    reload_dataloaders_every_n_epochs: int = 0
    inference_mode: bool = True


def check_val_schedule(val_check_interval: int | float | None, check_val_every_n_epoch: int | None) -> None:
    """Refuse a validation schedule the loop cannot keep (an interval of 0 divided the batch count at the first
    step), naming the value and what is accepted; the Trainer asks before it starts any rank."""
    interval = val_check_interval
    if isinstance(interval, bool) or not (interval is None or (isinstance(interval, int) and interval >= 1)
                                          or (isinstance(interval, float) and 0.0 < interval <= 1.0)):
        raise ConfigurationError(
            f"val_check_interval={interval!r}: use an int >= 1 (validate every that many training batches), a float "
            "in (0, 1] (that fraction of each epoch) or None (at the end of each epoch)."
        )
    if check_val_every_n_epoch is not None and (isinstance(check_val_every_n_epoch, bool) or
                                                check_val_every_n_epoch < 1):
        raise ConfigurationError(f"check_val_every_n_epoch must be >= 1 or None; got {check_val_every_n_epoch}.")


@dataclass
class Progress:
    """Where a fit stands: what checkpoints store (as ``loop``) and resume.

    Attributes:
        epoch: the current epoch. global_step: optimizer steps taken (skipped fp16 steps included).
        batch_idx: batches of the current epoch consumed by completed optimizer steps.
        epoch_done: the current epoch finished (a resume starts the next one).
        total_batches: batches consumed by completed optimizer steps, all epochs.
        val_marker: validations done on the current interval count (see ``FitLoop._val_schedule``).
        should_stop: a callback asked training to stop (``trainer.should_stop``); not saved.
        stop_reason: why the last fit stopped ("max_steps", "max_epochs", "max_time", "should_stop" or
            "TRAINKIT_MAX_STEPS"); saved, for the checkpoint written as it ends, and never restored.
    """

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    epoch_done: bool = False
    total_batches: int = 0
    val_marker: int = 0
    should_stop: bool = False
    stop_reason: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "should_stop"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self.batch_idx, self.epoch_done = state["batch_idx"], state["epoch_done"]
        self.val_marker = state.get("val_marker", 0)
        self.total_batches = state.get("total_batches", 0)


def has_validation(module: nn.Module, strategy: Strategy) -> bool:
    """Whether validation runs: the module overrides ``validation_step``, or the strategy's schedule says
    it evaluates this module another way."""
    overrides = type(module).validation_step is not TrainModule.validation_step
    schedule = capability(strategy, RunsSchedule)
    return schedule.evaluates(module, overrides) if schedule is not None else overrides


def _iterate(loader: Iterable[Any], epoch: int, seed: int, skip_batches: int) -> Iterator[Any]:
    """An epoch's batches, starting ``skip_batches`` in; ResumableSampler skips without loading."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        sampler.set_epoch(epoch)
        sampler.skip(skip_batches * loader.batch_size)
        if loader.generator is not None:
            loader.generator.manual_seed(seed * 1_000_003 + epoch)
        return iter(loader)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(skip_batches):
        next(it)
    return it


def _exhaust(batches: Iterator[Any]) -> None:
    """Ask a finished epoch's iterator for one more batch, as a ``for`` loop does before it stops: torch's
    RandomSampler draws once more from its generator when it runs out, so a loader with a seeded
    ``generator`` shuffles the next epoch as in a hand-written loop. One call, so an iterator whose
    length undercounts it is not drained."""
    next(batches, None)


class FitLoop:
    """Epochs of micro-batches grouped into optimizer steps, with validation on its schedule."""

    def __init__(self, config: LoopConfig, progress: Progress, module: nn.Module, strategy: Strategy,
                 step: WindowStep, hooks: HookDispatch, results: Results, data: DataConnector,
                 evaluation: EvalLoop, emit: Emit, boundary: Callable[[bool], bool] = lambda time_up: time_up,
                 timer: Timer | None = None) -> None:
        self.config, self.progress, self.module, self.strategy, self.step = config, progress, module, strategy, step
        self.hooks, self.results, self.data, self.evaluation, self.emit = hooks, results, data, evaluation, emit
        # after each optimizer step and its batch-end hooks, on every rank: given whether this rank's time is up,
        # says whether the ranks agree it is (``Saving.at_boundary``)
        self.boundary = boundary
        self.timer = timer  # max_time's clock (a ``Timer`` callback), or None
        self._time_up = False  # the ranks agreed the timer ran out: should_stop was set for it
        self._told_min = False  # said once that a stop waits for min_epochs / min_steps
        self._loaded_epoch = -1  # the epoch whose start the training loader was last built for
        step.with_batch_idx = takes_batch_idx(module.training_step)
        self.pending_rng: dict | None = None  # a resumed run's random state, applied when its epoch starts
        self.validates = bool(data.val_dataloaders) and has_validation(module, strategy)
        self.stop_at: int | None = None  # the global step TRAINKIT_MAX_STEPS stops this fit at (see steps_cap)
        scheduled = capability(strategy, RunsSchedule) is not None  # it runs forward and backward itself
        self._training_step = "the pipeline schedule" if scheduled else f"{type(module).__name__}.training_step"

    def state_dict(self) -> dict[str, Any]:
        return {**self.progress.state_dict(), "items_norm": self.step.items_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress.load_state_dict(state)
        self.step.items_norm = state.get("items_norm")
        if self.progress.epoch_done:
            self._next_epoch()

    def _next_epoch(self) -> None:
        p = self.progress
        p.epoch, p.batch_idx, p.epoch_done = p.epoch + 1, 0, False
        if self.config.check_val_every_n_epoch is not None:
            p.val_marker = 0

    @property
    def done(self) -> bool:
        p, c = self.progress, self.config
        return (p.should_stop and self._may_stop()) or (0 <= c.max_steps <= p.global_step) or (
            c.max_epochs is not None and p.epoch >= c.max_epochs) or (
            self.stop_at is not None and p.global_step >= self.stop_at)

    def _may_stop(self) -> bool:
        """``should_stop`` counts once ``min_epochs`` epochs are complete and ``min_steps`` steps taken (Lightning's
        ``_can_stop_early``); until then training goes on, and says so once."""
        p, c = self.progress, self.config
        if (c.min_epochs is None or p.epoch + p.epoch_done >= c.min_epochs) and (
                c.min_steps is None or p.global_step >= c.min_steps):
            return True
        if not self._told_min and self.strategy.is_global_zero:
            print(f"Training was asked to stop at step {p.global_step} (epoch {p.epoch}), before min_epochs="
                  f"{c.min_epochs} / min_steps={c.min_steps}: it goes on until both are reached.", flush=True)
        self._told_min = True
        return False

    def _stop_reason(self) -> str:
        p, c = self.progress, self.config
        if self.stop_at is not None and p.global_step >= self.stop_at:
            return STEPS_CAP
        if 0 <= c.max_steps <= p.global_step:
            return "max_steps"
        if c.max_epochs is not None and p.epoch >= c.max_epochs:
            return "max_epochs"
        return "max_time" if self._time_up else "should_stop"

    def run(self) -> None:
        cap = steps_cap()
        if cap is not None:
            self.stop_at = self.progress.global_step + cap
            if self.strategy.is_global_zero:
                print(f"{STEPS_CAP}={cap}: this fit stops after {cap} step(s), at step {self.stop_at}, and each "
                      "evaluation reads at most that many batches.", flush=True)
        p = self.progress
        self.step.guard.last_step = p.global_step
        activity.step = p.global_step  # a resumed fit's
        p.stop_reason, self._time_up, self._loaded_epoch = None, False, p.epoch  # loaders built as this fit started
        if self.config.reload_dataloaders_every_n_epochs and (p.epoch or p.batch_idx):
            self._reload()  # resumed: the loaders of the epoch it resumes in, built with that current_epoch
        if self.timer is not None and self.timer.spent:  # resumed with its time spent: no step
            self._time_up = p.should_stop = True
        self._check_data()
        self.hooks("on_fit_start")
        sanity = self.config.num_sanity_val_steps
        if sanity and self.validates:
            self._validate(limit=None if sanity < 0 else sanity, sanity=True)
        self.hooks("on_train_start")
        while not self.done:
            self.run_epoch()
        p.stop_reason = self._stop_reason()  # in the checkpoint on_train_end writes
        self.strategy.settle()
        self.step.guard.agree()  # a run that went non-finite ends with the error, before the last checkpoint
        self.hooks("on_train_end")
        self.hooks("on_fit_end")
        activity.now = None

    def _reload(self) -> None:
        """``reload_dataloaders_every_n_epochs``: the loaders built again from the module or DataModule."""
        self.data.reload()
        self._loaded_epoch = self.progress.epoch
        self.validates = bool(self.data.val_dataloaders) and has_validation(self.module, self.strategy)

    def _check_data(self) -> None:
        """No training batches on any rank is a configuration error, on every rank alike and before anything runs
        (an epoch without a step would otherwise follow another, forever)."""
        loader, limit = self.data.train_dataloader, self.config.limit_train_batches
        n = num_batches(loader, limit)
        strategy = self.strategy
        counts = strategy.all_gather_object(n) if strategy.world_size > 1 else [n]
        empty = [rank for rank, count in enumerate(counts) if count == 0]
        if not empty:
            return
        if limit is not None and num_batches(loader, None) > 0:
            why = f"limit_train_batches={limit} leaves none of its {num_batches(loader, None):.0f} batches"
        else:
            dataset = getattr(loader, "dataset", None)
            size = f"{len(dataset)} samples" if hasattr(dataset, "__len__") else "its samples"
            why = (f"its dataset of {size} makes no batch of batch_size={getattr(loader, 'batch_size', None)}"
                   f"{' with drop_last=True' if getattr(loader, 'drop_last', False) else ''}")
        ranks = "" if strategy.world_size == 1 else (
            f" on rank(s) {', '.join(map(str, empty))} of {strategy.world_size}" if len(empty) < len(counts)
            else f" on each of the {strategy.world_size} ranks")
        raise ConfigurationError(
            f"No training data{ranks}: the training dataloader yields no batches ({why}). Give it more samples, a "
            "smaller batch_size, drop_last=False or a larger limit_train_batches; with use_distributed_sampler=False "
            "every rank's own loader must yield batches.")

    def _validate(self, limit: int | float | None, sanity: bool = False) -> None:
        self.evaluation.run(self.module, "validate", self.data.val_dataloaders, limit, sanity=sanity, fitting=True)
        self.results.loop = "train"

    def run_epoch(self) -> None:
        p, c, step, module = self.progress, self.config, self.step, self.module
        every = c.reload_dataloaders_every_n_epochs
        if every and p.epoch % every == 0 and p.epoch != self._loaded_epoch and p.batch_idx == 0:
            self._reload()  # at epochs N, 2N, ...: the same ones whether or not the run was resumed
        loader = self.data.train_dataloader
        assert loader is not None
        limit = num_batches(loader, c.limit_train_batches)
        val_every = self._val_schedule(limit)
        k = step.k
        module.train()
        self.results.loop = "train"
        self.hooks("on_train_epoch_start")
        batches = _iterate(loader, p.epoch, c.seed, p.batch_idx)
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng)
            self.pending_rng = None
        batch_idx = p.batch_idx
        step.window = 0
        batch_start, batch_end = self.hooks.fns("on_train_batch_start"), self.hooks.fns("on_train_batch_end")
        moves = self.data.moves_batches
        while batch_idx < limit and not self.done:
            activity.enter("the training dataloader", p.global_step)
            try:
                batch = next(batches)
            except StopIteration:
                break
            if moves:
                batch = self.data.to_device(batch)
            for hook in batch_start:
                hook(batch, batch_idx)
            self.results.batch = batch
            boundary = step.window + 1 == k or batch_idx + 1 >= limit
            activity.enter(self._training_step)
            outputs = step.micro_step(module, batch, batch_idx, boundary)
            batch_idx += 1
            stepped = boundary and self._finish_step(batch_idx, val_every)
            for hook in batch_end:
                hook(outputs, batch, batch_idx - 1)
            if stepped:
                self._step_ended()
        if batch_idx != p.batch_idx and self._finish_step(batch_idx, val_every):  # a window cut short by the data
            self._step_ended()
        if batch_idx == 0 and not self.done:  # a loader without a length, found empty as it ran: alone on a rank, so
            error = ConfigurationError if self.strategy.world_size == 1 else RuntimeError  # the others are told
            raise error(
                f"No training data: the training dataloader yielded no batch in epoch {p.epoch}; an epoch without a "
                "step would follow another, forever. Check the dataset (and, over several ranks, each rank's part).")
        if self.done and batch_idx < limit:
            if self.validates and self.stop_at is not None and p.global_step >= self.stop_at:
                self._validate(c.limit_val_batches)  # a fit cut short by TRAINKIT_MAX_STEPS validates as at its end
            return
        activity.enter("the end of the epoch", p.global_step)
        if c.limit_train_batches is None:
            _exhaust(batches)
        if math.isinf(val_every) and self._validation_epoch():
            self._validate(c.limit_val_batches)
        p.epoch_done = True
        self.results.epoch_end = True  # self.log in the module's epoch-end hook aggregates per epoch
        self.hooks.module("on_train_epoch_end")
        self.results.epoch_end = False
        self.emit(self.results.epoch_metrics())
        step.step_scheduler("epoch", p.epoch + 1, self._metrics)  # before the callbacks: epoch-end checkpoints
        self.hooks.callbacks("on_train_epoch_end")  # include it
        self._next_epoch()

    def _step_ended(self) -> None:
        self.hooks("on_train_step_end", self.step.timing)
        activity.enter("the step's end (checkpoint commit, preemption check)")
        timer = self.timer
        if self.boundary(timer is not None and timer.time_up) and not self._time_up and timer is not None:
            self._time_up = self.progress.should_stop = True  # every rank at this boundary
            timer.announce()
        self.results.boundary += 1  # what is logged from now on belongs to the next step

    def _metrics(self) -> dict[str, float]:
        return self.results.local_values(prog_bar_only=False)

    def _finish_step(self, batch_idx: int, val_every: float) -> bool:
        """The optimizer boundary: the step, then logging and validation on their schedules. False when the
        window ran no backward (every micro-batch returned None) and nothing was stepped."""
        p, c = self.progress, self.config
        p.total_batches += batch_idx - p.batch_idx
        p.batch_idx = batch_idx
        stepped = self.step.step()
        if stepped is None:
            return False
        p.global_step += self.step.taken  # under manual optimization each optimizer's step counts, as in Lightning
        self.step.guard.end_step(p.global_step)
        activity.step = p.global_step  # what the hooks from here on see as trainer.global_step
        if stepped:  # a step skipped for overflow does not advance the LR schedule
            self.step.step_scheduler("step", p.global_step, self._metrics)
        if p.global_step // c.log_every_n_steps > (p.global_step - self.step.taken) // c.log_every_n_steps:
            activity.enter("logging")
            self.step.guard.read()  # a logging step waits for the device anyway
            self.emit(self.results.step_metrics())
        counted = p.total_batches if c.check_val_every_n_epoch is None else batch_idx
        if counted // val_every > p.val_marker and self._validation_epoch():
            p.val_marker = int(counted // val_every)
            self._validate(c.limit_val_batches)
        return True

    def _val_schedule(self, limit: float) -> float:
        """Training batches between validations, or inf to validate at epoch ends only.

        As in Lightning: a float is a fraction of the epoch; an int counts batches within the epoch (it
        may not exceed the epoch) unless ``check_val_every_n_epoch`` is None, in which case it counts
        batches across epochs (iteration-based training).
        """
        c = self.config
        interval = c.val_check_interval
        if not self.validates or interval is None:
            return math.inf
        if isinstance(interval, float) and interval <= 1.0:
            if interval == 1.0:
                return math.inf
            if math.isinf(limit):
                raise ValueError("A fractional val_check_interval needs a training dataloader with a length.")
            return max(1, int(limit * interval))
        if c.check_val_every_n_epoch is not None and interval > limit:
            raise ValueError(
                f"val_check_interval={interval} exceeds the {int(limit)} training batches of an epoch, so validation "
                "would never run. Lower it, or set check_val_every_n_epoch=None to count batches across epochs."
            )
        return int(interval)

    def _validation_epoch(self) -> bool:
        every = self.config.check_val_every_n_epoch
        return self.validates and (every is None or (self.progress.epoch + 1) % every == 0)


def loss_logger(results: Results) -> Callable[[Tensor], None]:
    """How a schedule-running strategy's batch loss reaches the logs: as ``train_loss``, like a
    ``training_step`` that logs it with ``prog_bar=True``."""
    return lambda loss: results.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
