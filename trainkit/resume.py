"""A run's checkpoint state besides the strategy's tensors: what meta.json records (loop progress,
scheduler, loss scaler, callbacks, data, hyperparameters, the user's entries) and how a run resumes it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from trainkit import checkpoint as ckpt
from trainkit.utils import jsonable
from trainkit_strategies.state import StateMismatch

if TYPE_CHECKING:
    from trainkit.trainer import Trainer


def checkpoint_meta(trainer: Trainer) -> dict[str, Any]:
    """Everything but the tensors (``trainer.fit_loop`` must exist: checkpoints are written during fit)."""
    module, strategy = trainer.module, trainer.strategy
    assert module is not None and trainer.fit_loop is not None
    sched = trainer.lr_scheduler
    meta: dict[str, Any] = {
        "strategy": strategy.name,
        "precision": trainer.precision.name,
        "loop": trainer.fit_loop.state_dict(),
        "hyperparameters": jsonable(dict(module.hparams)),
        "optimizer": {
            "class": type(strategy.optimizer).__name__ if strategy.optimizer else None,
            "param_groups": strategy.optimizer_groups(),
        },
        "scheduler": sched.state_dict() if sched is not None else None,
        "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else None,
        "configs": module_configs(module),
        "saved_at": time.time(),
    }
    user: dict[str, Any] = {}
    module.on_save_checkpoint(user)
    for cb in trainer.callbacks:
        cb.on_save_checkpoint(trainer, module, user)
    meta["user"] = user
    return meta


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


def resolve(checkpoint_dir: Path, ckpt_path: str | Path) -> Path | None:
    """The checkpoint ``ckpt_path`` names: "last" is the newest in ``checkpoint_dir`` (None, with a warning,
    when there is none); a directory holding a ``latest`` pointer means the checkpoint it points at."""
    if str(ckpt_path) == "last":
        found = ckpt.latest(checkpoint_dir)
        if found is None:
            rank_zero_warn(f"ckpt_path='last' but {checkpoint_dir} holds no checkpoint; starting fresh.")
        return found
    path = Path(ckpt_path)
    if path.is_dir() and not (path / ckpt.META).exists() and (path / ckpt.LATEST).exists():
        return ckpt.latest(path)
    return path


def restore(trainer: Trainer, path: Path, fn: str) -> dict[str, Any] | None:
    """Load the checkpoint at ``path`` into ``trainer``'s run of ``fn``: the model always; under "fit" also
    the optimizer, loop progress, scheduler, scaler, callbacks and data state. Returns the random state the
    resumed training continues from (None outside fit)."""
    module, strategy = trainer.module, trainer.strategy
    assert module is not None
    reader = ckpt.CheckpointReader(path)
    meta = reader.meta
    training = fn == "fit"
    try:
        strategy.load_state(reader, meta["optimizer"]["param_groups"] if training else None)
    except StateMismatch as err:
        raise ckpt.CheckpointError(
            f"Checkpoint {path} was saved from another model than this one. {err}\nLoad it into the model it was "
            "trained with (the same class and --model options), or start without --ckpt_path."
        ) from err
    module.on_load_checkpoint(meta.get("user", {}))
    if not training:
        return None
    assert trainer.fit_loop is not None
    trainer.fit_loop.load_state_dict(meta["loop"])
    sched = trainer.lr_scheduler
    if sched is not None and meta.get("scheduler") is not None:
        sched.load_state_dict(meta["scheduler"])
    if trainer.scaler is not None and meta.get("scaler") is not None:
        trainer.scaler.load_state_dict(meta["scaler"])
    for cb in trainer.callbacks:
        state = meta["callbacks"].get(cb.state_key)
        if state is not None:
            cb.load_state_dict(state)
        cb.on_load_checkpoint(trainer, module, meta.get("user", {}))
    if trainer.datamodule is not None and meta.get("datamodule") is not None:
        trainer.datamodule.load_state_dict(meta["datamodule"])
    ranks = meta.get("ranks", [])
    if meta.get("world_size") == trainer.world_size and len(ranks) == trainer.world_size:
        return ranks[trainer.global_rank]["rng"]
    if ranks:
        rank_zero_warn(
            f"The checkpoint was saved with {meta.get('world_size')} ranks and this run has {trainer.world_size}: "
            "random state is re-seeded from rank 0's, so dropout noise will not continue bitwise."
        )
        return ranks[0]["rng"]
    return None


def resume_hint(checkpoint_dir: Path) -> str:
    """What to tell a user whose run failed: the intact checkpoint to resume from, if any."""
    try:
        last = ckpt.latest(checkpoint_dir)
    except ckpt.CheckpointError:
        last = None
    if last is None:
        return "No checkpoint was committed before the failure."
    return f"The last committed checkpoint, {last}, is intact: resume with --ckpt_path last (or ckpt_path='last')."
