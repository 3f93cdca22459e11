"""A run's checkpoint state besides the strategy's tensors: what meta.json records (loop progress,
scheduler, loss scaler, callbacks, data, hyperparameters, the user's entries) and how a run resumes it.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from trainkit import checkpoint as ckpt
from trainkit.callbacks.checkpointing import ModelCheckpoint, best_of
from trainkit.errors import ConfigurationError
from trainkit.rundir import newest
from trainkit.utils import jsonable, stored_as_repr
from trainkit_strategies.state.pieces import StateMismatch

if TYPE_CHECKING:
    from trainkit_strategies import Strategy

Stateful = Any  # anything with ``state_dict()`` and ``load_state_dict(state)``; None where a run has none
States = Mapping[str, "Stateful | Mapping[str, Stateful] | None"]


def checkpoint_meta(states: States, module: Any, strategy: Strategy, precision: str,
                    on_save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Everything a checkpoint holds but the tensors: each of ``states`` (``meta[key]``: its ``state_dict()``; a
    mapping of them, by key, for ``callbacks``), the strategy's name and optimizer groups, the module's
    hyperparameters and configurations, and what ``on_save`` (the ``on_save_checkpoint`` hooks) adds under
    ``user``."""
    meta: dict[str, Any] = {
        "strategy": strategy.name,
        "precision": precision,
        "hyperparameters": jsonable(dict(module.hparams)),
        "hyperparameters_repr": sorted(k for k, v in module.hparams.items() if stored_as_repr(v)),
        "optimizer": {
            "class": type(strategy.optimizer).__name__ if strategy.optimizer else None,
            "param_groups": strategy.optimizer_groups(),
        },
        "configs": module_configs(module),
        "saved_at": time.time(),
    }
    meta |= {key: _state_of(obj) for key, obj in states.items()}
    user: dict[str, Any] = {}
    on_save(user)
    meta["user"] = user
    return meta


class RunShape:
    """meta.json's ``run``: how the run walks its data (one rank's batch, the data-parallel ranks, the sampler's seed)
    and steps (accumulation). A resumed fit compares it with the checkpoint's (``config_changes``), because the loop
    saves its position in batches: it is never restored, the new run's settings stand."""

    def __init__(self, data: Any, accumulate_grad_batches: int) -> None:
        self.data, self.accumulate_grad_batches = data, accumulate_grad_batches

    def state_dict(self) -> dict[str, Any]:
        strategy = self.data.strategy
        batch = getattr(self.data.train_dataloader, "batch_size", None)
        return {"batch_size": batch, "dp_size": strategy.dp_size, "world_size": strategy.world_size,
                "global_batch": batch * strategy.dp_size * self.accumulate_grad_batches if batch else None,
                "seed": self.data.seed, "accumulate_grad_batches": self.accumulate_grad_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see the class)."""


def config_changes(meta: Mapping[str, Any], module: Any, run: RunShape | None) -> list[str]:
    """How this run differs from the one that saved ``meta``: its batch per data-parallel step (with the samples of
    the interrupted epoch that a position counted in batches then skips or trains twice), sampler seed,
    accumulation, and the module's hyperparameters (``saved → now``)."""
    changes: list[str] = []
    saved, now = meta.get("run"), run.state_dict() if run is not None else None
    if saved and now:
        changes += _run_changes(saved, now, meta.get("loop") or {})
    hparams = meta.get("hyperparameters") or {}
    current = jsonable(dict(module.hparams))
    for key in sorted(hparams.keys() | current.keys()):
        was, is_ = hparams.get(key, _UNSET), current.get(key, _UNSET)
        if _comparable(was) != _comparable(is_):
            changes.append(f"{key} {_shown(was)} → {_shown(is_)}")
    return changes


_UNSET = object()


def _run_changes(saved: Mapping[str, Any], now: Mapping[str, Any], loop: Mapping[str, Any]) -> list[str]:
    changes = []
    batch, ranks = (saved.get("batch_size"), saved.get("dp_size")), (now.get("batch_size"), now.get("dp_size"))
    if None not in batch + ranks and batch[0] * batch[1] != ranks[0] * ranks[1]:
        before, after = batch[0] * batch[1], ranks[0] * ranks[1]
        said = f"batch_size {batch[0]} → {ranks[0]}" if batch[1] == ranks[1] else \
            f"batch_size {batch[0]} on {batch[1]} data-parallel rank(s) → {ranks[0]} on {ranks[1]}"
        position = loop.get("batch_idx", 0) if not loop.get("epoch_done") else 0
        if position:  # saved as batches of the epoch: the samples they cover change with the batch
            trained, resumed = position * before, position * after
            first, last = sorted((trained, resumed))
            fate = "skipped" if resumed > trained else "trained twice"
            said += (f" (epoch {loop.get('epoch', 0)} resumes {position} batches in, at sample {resumed} of its order "
                     f"where the saved run had trained {trained}: samples {first} to {last - 1} are {fate})")
        changes.append(said)
    for key, name in (("seed", "sampler seed"), ("accumulate_grad_batches", "accumulate_grad_batches")):
        if saved.get(key) is not None and saved.get(key) != now.get(key):
            changes.append(f"{name} {saved[key]} → {now[key]}")
    return changes


def _comparable(value: Any) -> Any:
    """A saved hyperparameter as compared: a repr's object address (``<Foo object at 0x7f...>``) differs from run to
    run and says nothing."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", value) if isinstance(value, str) else value


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "(unset)"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _state_of(obj: Any) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return {key: inner.state_dict() for key, inner in obj.items()}
    return obj.state_dict()


def module_configs(module: Any) -> dict[str, dict[str, Any]]:
    """The configurations of the submodules that carry one the way Hugging Face models do (a ``config`` with
    ``to_dict()``), by submodule name ("" for the module itself), with the class it configures: what ``trainkit
    export --submodule`` writes as ``config.json`` so ``from_pretrained`` can load the export."""
    out = {}
    for name, mod in module.named_modules():
        config = getattr(mod, "config", None)
        if callable(getattr(config, "to_dict", None)):
            entry = jsonable(config.to_dict())
            entry.setdefault("architectures", [type(mod).__name__])
            if not entry["architectures"]:
                entry["architectures"] = [type(mod).__name__]
            out[name] = entry
    return out


def resolve(checkpoint_dir: Path, ckpt_path: str | Path, callback: ModelCheckpoint | None = None) -> Path | None:
    """The checkpoint ``ckpt_path`` names: "last" is the newest in ``checkpoint_dir`` (None, with a warning,
    when there is none); "best" the best ``callback`` ranked, or the one its record in the newest checkpoint names
    (``best_checkpoint``); a directory holding a ``latest`` pointer means the checkpoint it points at."""
    if str(ckpt_path) == "best":
        return best_checkpoint(callback, checkpoint_dir)
    if str(ckpt_path) == "last":
        found = newest(checkpoint_dir)
        if found is None:
            rank_zero_warn(f"ckpt_path='last' but {checkpoint_dir} holds no checkpoint; starting fresh.")
        return found
    return checkpoint_in(Path(ckpt_path))


def best_checkpoint(callback: ModelCheckpoint | None, checkpoint_dir: Path) -> Path:
    """What ``ckpt_path="best"`` names: the best checkpoint ``callback`` ranked in this process (Lightning's
    ``best_model_path``: without a monitor, the newest it saved) or, where it has saved none (a new process: ``trainkit
    validate --ckpt_path best``), the best that the newest checkpoint in ``checkpoint_dir`` (or its versions) records
    of a ``ModelCheckpoint`` that wrote it, beside it: a monitored one's first."""
    if callback is not None and callback.best_model_path is not None:
        return callback.best_model_path
    found = newest(checkpoint_dir)
    records = ckpt.read_meta(found).get("callbacks") or {} if found is not None else {}
    kept = [r for r in records.values() if isinstance(r, dict) and "saved" in r and "monitor" in r]
    wanted = callback.monitor if callback is not None else None
    kept.sort(key=lambda r: (not r["monitor"], r["monitor"] != wanted))  # the Trainer's own monitor's record first
    if not kept:
        raise ConfigurationError(
            f'ckpt_path="best" needs checkpoints written by a ModelCheckpoint, and {checkpoint_dir} holds none. Fit '
            'first (the default ModelCheckpoint keeps the newest; ModelCheckpoint(monitor="val_loss") the best by '
            "val_loss; on the command line --trainer.callbacks+=ModelCheckpoint --trainer.callbacks.monitor "
            'val_loss), or pass ckpt_path="last" or a checkpoint directory.')
    assert found is not None
    for record in kept:
        best = best_of(record["saved"], record.get("mode", "min"), bool(record["monitor"]))
        if best is not None:
            return found.parent / best["name"]
    names = " or ".join(sorted({repr(r["monitor"]) for r in kept}))
    raise ConfigurationError(f'ckpt_path="best": the ModelCheckpoint monitoring {names} ranked no checkpoint in '
                             f"{found.parent}: the metric was never logged at a save. Log it where checkpoints are "
                             'saved (in validation_step, say), or pass ckpt_path="last".')


def checkpoint_in(path: Path) -> Path | None:
    """``path``, or, for a directory holding a ``latest`` pointer and no meta.json, the newest checkpoint among it and
    the versions fresh runs wrote of it (``rundir.py``)."""
    if path.is_dir() and not (path / ckpt.META).exists() and (path / ckpt.LATEST).exists():
        return newest(path)
    return path


def restore(path: Path, module: Any, strategy: Strategy, states: States | None,
            on_load: Callable[[dict[str, Any]], None], world_size: int, rank: int) -> dict[str, Any] | None:
    """Load the checkpoint at ``path``: the model always; with ``states`` (a fit resuming) also the optimizer and
    each of ``states`` that the checkpoint holds; then ``on_load`` (the ``on_load_checkpoint`` hooks) with the
    user's entries. Returns the random state a resumed fit continues from (None without ``states``)."""
    reader = ckpt.CheckpointReader(path)
    meta = reader.meta
    try:
        strategy.load_state(reader, meta["optimizer"]["param_groups"] if states is not None else None)
    except StateMismatch as err:
        raise ckpt.CheckpointError(
            f"Checkpoint {path} was saved from another model than this one. {err}\nLoad it into the model it was "
            "trained with (the same class and --model options), or start without --ckpt_path."
        ) from err
    for key, obj in (states or {}).items():
        saved = meta.get(key)
        if obj is None or saved is None:
            continue
        if isinstance(obj, Mapping):
            for inner_key, inner in obj.items():
                if saved.get(inner_key) is not None:
                    inner.load_state_dict(_as_saved(saved[inner_key], inner.state_dict()))
        else:
            obj.load_state_dict(_as_saved(saved, obj.state_dict()))
    on_load(meta.get("user", {}))
    if states is None:
        return None
    changes = config_changes(meta, module, states.get("run"))
    if changes:
        rank_zero_warn(f"Resuming {path} with a different configuration than it was saved with: "
                       f"{'; '.join(changes)}.")
    ranks = meta.get("ranks", [])
    if meta.get("world_size") == world_size and len(ranks) == world_size:
        return ranks[rank]["rng"]
    if ranks:
        rank_zero_warn(
            f"The checkpoint was saved with {meta.get('world_size')} ranks and this run has {world_size}: "
            "random state is re-seeded from rank 0's, so dropout noise will not continue bitwise."
        )
        return ranks[0]["rng"]
    return None


def _as_saved(saved: Any, current: Any) -> Any:
    """``saved``, read back from meta.json, with the key types and mapping types of ``current`` (the object's state
    now): JSON writes every key as a string and every mapping as a dict, and a scheduler's state has integer keys
    (MultiStepLR's ``milestones``, a Counter of epochs) that as strings never match, so the rate would stop
    decaying after a resume."""
    if isinstance(saved, list) and isinstance(current, list | tuple) and len(saved) == len(current):
        return [_as_saved(s, c) for s, c in zip(saved, current, strict=True)]  # several schedulers' states
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return saved
    keys = {str(k): k for k in current}
    numbered = bool(current) and all(isinstance(k, int) for k in current)
    out = {}
    for key, value in saved.items():
        key = keys.get(key, int(key) if numbered and key.lstrip("-").isdigit() else key)
        out[key] = _as_saved(value, current.get(key))
    return Counter(out) if isinstance(current, Counter) else out


def resume_hint(checkpoint_dir: Path, stop: str = "the failure") -> str:
    """What to tell a user whose run failed (or stopped otherwise: ``stop``): the intact checkpoint to resume from,
    if any."""
    try:
        last = ckpt.latest(checkpoint_dir)
    except ckpt.CheckpointError:
        last = None
    if last is None:
        return f"No checkpoint was committed before {stop}."
    return f"The last committed checkpoint, {last}, is intact: resume with --ckpt_path last (or ckpt_path='last')."


def report_restored(path: Path, progress: Any, fit_loop: Any) -> str:
    """What a resume says (rank 0 prints it): the checkpoint and where the run stands; for a fit that has nothing
    left to do, that, and how to train further."""
    if fit_loop is None:
        return f"Restored {path}."
    said = f"Restored {path}: step {progress.global_step}, epoch {progress.epoch}."
    if not fit_loop.done:
        return said
    config = fit_loop.config
    reached = f"max_steps={config.max_steps}" if 0 <= config.max_steps <= progress.global_step else \
        f"max_epochs={config.max_epochs}"
    return (f"{said} Nothing left to do: the run already reached {reached}; raise --trainer.max_steps (or "
            "--trainer.max_epochs) to train further.")
