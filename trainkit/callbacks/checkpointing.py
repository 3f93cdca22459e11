"""ModelCheckpoint and OnExceptionCheckpoint: when universal checkpoints get written, and which stay."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from trainkit.callbacks.base import Callback
from trainkit.finite import NonFiniteError
from trainkit.signals import Preempted

if TYPE_CHECKING:
    from trainkit.hooks import StepTiming
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer


def best_of(saved: list[dict[str, Any]], mode: str, monitored: bool = True) -> dict[str, Any] | None:
    """The entry of ``saved`` (``{"name", "step", "score"}`` each) with the best score by ``mode``; None if none has
    one. Not ``monitored``, the newest, as Lightning's ``best_model_path`` of a ModelCheckpoint without a monitor."""
    if not monitored:
        return max(saved, key=lambda s: s["step"], default=None)
    scored = [s for s in saved if s["score"] is not None]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda s: s["score"])


class ModelCheckpoint(Callback):
    """Save checkpoints periodically; keep the best ``save_top_k`` (by ``monitor``) or the newest.

    Args:
        dirpath: directory of checkpoints (default ``<default_root_dir>/checkpoints``). Its ``latest``
            pointer always names the newest checkpoint; ``ckpt_path="last"`` resumes from it, ``ckpt_path="best"``
            loads the best by ``monitor``, without one the newest this callback saved (``best_model_path``, or, in a
            later process, the newest checkpoint's record of it).
        filename: name template; ``{epoch}``, ``{step}`` and logged metric names are filled in.
        monitor: metric to rank checkpoints by (None: rank by recency).
        mode: "min" or "max" for ``monitor``.
        save_top_k: how many to keep (-1: all; 0: none besides the newest when ``save_last``).
        save_last: always keep the newest checkpoint and write one when training ends.
        every_n_train_steps: save every N optimizer steps.
        every_n_epochs: save at the end of every N-th epoch (default 1 when no step trigger is set).
        async_save: copy the state to host memory at the step boundary and write the files in the
            background while training continues; the checkpoint (and ``latest``) appears once every rank's
            files are durable, and older checkpoints are pruned only then. A save waits for the one before.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "epoch={epoch}-step={step}",
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = True,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        async_save: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint mode must be 'min' or 'max'; got {mode!r}.")
        if save_top_k < -1:
            raise ValueError(f"save_top_k must be >= -1; got {save_top_k}.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.base_dirpath = self.dirpath  # as given; a fit may write to a version of it (``rundir.py``)
        self.claimed: Path | None = None  # the directory this callback's last fit wrote to
        self.filename, self.monitor, self.mode = filename, monitor, mode
        self.save_top_k, self.save_last = save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None or every_n_train_steps else 1
        self.async_save = async_save
        self.saved: list[dict[str, Any]] = []  # {"name", "step", "score"} of checkpoints this callback keeps
        self._last_step = -1  # the step of the last save (save_last adds none at the same step)
        self._warned_missing = self._warned_stale = False

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint[{self.monitor or 'recent'},{self.base_dirpath}]"

    def state_dict(self) -> dict[str, Any]:
        """What it keeps, and how it ranks them: what ``ckpt_path="best"`` reads in a later process."""
        return {"saved": self.saved, "last_step": self._last_step, "monitor": self.monitor, "mode": self.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = list(state.get("saved", []))
        self._last_step = state.get("last_step", -1)

    @property
    def best(self) -> dict[str, Any] | None:
        return best_of(self.saved, self.mode, self.monitor is not None)

    @property
    def best_model_path(self) -> Path | None:
        best = self.best
        return self.dirpath / best["name"] if best and self.dirpath else None

    def resolve_dirpath(self, trainer: Trainer) -> Path:
        if self.base_dirpath is None:
            self.base_dirpath = trainer.default_root_dir / "checkpoints"
        if self.dirpath is None:
            self.dirpath = self.base_dirpath
        return self.dirpath

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self.resolve_dirpath(trainer)

    def on_train_step_end(self, trainer: Trainer, module: TrainModule, timing: StepTiming) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0:
            self.save(trainer)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.save_last and trainer.global_step != self._last_step:
            self.save(trainer)

    def save(self, trainer: Trainer, wait: bool = False) -> Path | None:
        """Write a checkpoint now (collective; in the background with ``async_save`` unless ``wait``) and prune
        the ones no longer kept once it is committed."""
        if self.save_top_k == 0 and not self.save_last:
            return None
        dirpath = self.resolve_dirpath(trainer)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        score = None
        if self.monitor is not None:
            score = metrics.get(self.monitor)
            if score is None and not self._warned_missing:
                rank_zero_warn(f"ModelCheckpoint(monitor={self.monitor!r}): the metric has not been logged yet "
                               f"(logged: {sorted(metrics)}); this checkpoint is kept only as the newest.")
                self._warned_missing = True
            if score is not None and not math.isfinite(score):
                score = None  # never ranked: a NaN or infinite score is neither best nor worst
            if score is not None and trainer.results.logged_at(self.monitor) != trainer.results.boundary:
                if not self._warned_stale:
                    rank_zero_warn(f"ModelCheckpoint(monitor={self.monitor!r}): the checkpoint at step "
                                   f"{trainer.global_step} has no {self.monitor} of its own (the latest is from an "
                                   "earlier step), so it is kept as the newest but not ranked; save where the metric "
                                   "is logged (with validation, every_n_train_steps a multiple of val_check_interval).")
                    self._warned_stale = True
                score = None
        fields = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        fields |= {k.replace("/", "_"): v for k, v in metrics.items()}
        try:
            name = self.filename.format(**fields)
        except KeyError as err:
            raise KeyError(f"ModelCheckpoint filename {self.filename!r} names {err}, which is not logged; "
                           f"available: {sorted(fields)}.") from err
        name = self._unclaimed(dirpath, name.replace("/", "_"))
        score, name = trainer.strategy.broadcast_object((score, name))
        self._last_step = trainer.global_step  # before saving: the checkpoint carries this callback's state
        self.saved = [s for s in self.saved if s["name"] != name]
        self.saved.append({"name": name, "step": trainer.global_step, "score": score})
        prune = (lambda _: self._prune(dirpath, name)) if trainer.is_global_zero else None
        return trainer.save_checkpoint(dirpath, name, async_save=self.async_save and not wait, on_commit=prune)

    def _unclaimed(self, dirpath: Path, name: str) -> str:
        """``name``, or ``name-v1``, ``-v2``, ... where a checkpoint this run did not write holds it (a run resumed
        from an older checkpoint reaching the steps of newer ones): another run's checkpoint is never replaced."""
        if name in {s["name"] for s in self.saved} or not (dirpath / name).exists():
            return name
        version = 1
        while (dirpath / f"{name}-v{version}").exists():
            version += 1
        return f"{name}-v{version}"

    def _prune(self, dirpath: Path, newest: str) -> None:
        keep = {newest} if self.save_last or self.save_top_k != 0 else set()
        if self.save_top_k == -1:
            keep |= {s["name"] for s in self.saved}
        elif self.monitor is None:
            recent = sorted(self.saved, key=lambda s: s["step"])[-self.save_top_k :] if self.save_top_k else []
            keep |= {s["name"] for s in recent}
        else:
            scored = [s for s in self.saved if s["score"] is not None]
            scored.sort(key=lambda s: s["score"], reverse=self.mode == "max")
            keep |= {s["name"] for s in scored[: self.save_top_k]}
        for entry in [s for s in self.saved if s["name"] not in keep]:
            shutil.rmtree(dirpath / entry["name"], ignore_errors=True)
        self.saved = [s for s in self.saved if s["name"] in keep]


class OnExceptionCheckpoint(Callback):
    """On Ctrl-C or an error, save a resumable checkpoint of the last completed optimizer step.

    Under several ranks a checkpoint is collective, so it is written only when every rank is
    interrupted together (Ctrl-C reaches the whole process group); an error on one rank is not saved.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str = "on_exception") -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        if trainer.state != "fit" or trainer.strategy.optimizer is None or isinstance(exception, Preempted):
            return  # a preempted run has saved its checkpoint already
        if isinstance(exception, NonFiniteError):
            return  # its weights are not worth keeping: the last finite checkpoint stays ``latest``
        if trainer.world_size > 1 and not isinstance(exception, KeyboardInterrupt):
            return
        dirpath = self.dirpath or trainer.checkpoint_dir
        path = trainer.save_checkpoint(dirpath, self.filename)
        rank_zero_warn(f"Saved {path} after {type(exception).__name__}; resume with --ckpt_path {path}")

