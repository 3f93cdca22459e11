"""Timer: stop training once a duration has passed (``Trainer(max_time=...)`` adds one), as Lightning's Timer does."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_info

from trainkit.callbacks.base import Callback
from trainkit.errors import ConfigurationError

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer

Duration = str | timedelta | Mapping[str, int]
STAGES = ("train", "validate", "test")


def parse_duration(duration: Duration, name: str = "max_time") -> float:
    """``duration`` in seconds: ``"DD:HH:MM:SS"``, a ``timedelta``, or a dict of ``timedelta``'s arguments
    (``{"hours": 1, "minutes": 30}``)."""
    value: Any = duration
    if isinstance(value, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", value.strip())
        if match is None:
            raise ConfigurationError(f"{name}={duration!r}: write it as DD:HH:MM:SS (days, hours, minutes, seconds), "
                                     "e.g. '00:12:00:00' for 12 hours.")
        days, hours, minutes, seconds = map(int, match.groups())
        value = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, Mapping):
        try:
            value = timedelta(**dict(value))
        except TypeError as err:
            raise ConfigurationError(f"{name}={dict(value)!r}: its keys must be timedelta's (weeks, days, hours, "
                                     f"minutes, seconds, ...): {err}.") from None
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ConfigurationError(f"{name}={duration!r}: give a positive duration as 'DD:HH:MM:SS', a timedelta or a "
                                 "dict such as {'hours': 1}.")
    return value.total_seconds()


class Timer(Callback):
    """Tracks the time spent training, validating and testing, and stops training once ``duration`` has passed.

    Training time counts from ``on_train_start`` to ``on_train_end``, plus what the checkpoint a fit resumes from had
    spent (this callback's state), so a run preempted and resumed stops after ``duration`` in all. Each rank checks
    its clock at every optimizer-step boundary and the ranks agree there, with the preemption flags
    (``signals.py``): every rank stops after the same step, the step after the first rank's time ran out (at once on
    one process). A resumed fit whose time is already spent takes no step.

    Args:
        duration: ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict such as ``{"hours": 12}``; None only measures.
        interval: "step" (the check at optimizer-step boundaries; Lightning's "epoch" is not offered).
        verbose: say on rank 0 when the time limit stops training.
    """

    def __init__(self, duration: Duration | None = None, interval: str = "step", verbose: bool = True) -> None:
        if interval != "step":
            raise ConfigurationError(f"Timer(interval={interval!r}): trainkit checks the time at every optimizer step "
                                     "(interval='step'); stop at an epoch's end with max_epochs instead.")
        self.duration = parse_duration(duration, "Timer duration") if duration is not None else None
        self.interval, self.verbose = interval, verbose
        self._start: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0  # training time spent before the checkpoint this fit resumed from

    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` ("train", "validate" or "test") last started (``time.monotonic()``), or None."""
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds ``stage`` ran (training: since the first fit of the run, resumes included)."""
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        return self.duration - self.time_elapsed(stage) if self.duration is not None else None

    @property
    def time_up(self) -> bool:
        """This rank's training time reached ``duration`` (the ranks agree on it at the step boundary)."""
        return self.duration is not None and self.time_elapsed() >= self.duration

    @property
    def spent(self) -> bool:
        """The checkpoint this fit resumed from had spent the whole ``duration``: the same on every rank (the offset is
        the checkpoint's), so the ranks stop before the first step without asking each other."""
        return self.duration is not None and self._offset >= self.duration

    def announce(self) -> None:
        if self.verbose:
            rank_zero_info(f"Time limit reached: {timedelta(seconds=round(self.time_elapsed()))} of training "
                           f"(max_time {timedelta(seconds=round(self.duration or 0))}); stopping.")

    @property
    def state_key(self) -> str:
        return "Timer"

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))

    def _mark(self, table: dict[str, float | None], stage: str) -> None:
        table[stage] = time.monotonic()
        if table is self._start:
            self._end[stage] = None

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._mark(self._start, "train")

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._mark(self._end, "train")

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._mark(self._start, "validate")

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._mark(self._end, "validate")

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._mark(self._start, "test")

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._mark(self._end, "test")
