"""The Trainer's arguments checked and normalised before any rank starts, as Lightning 2.x reads them.

A wrong value fails here, naming the value and what is accepted, instead of as a traceback from every rank once the
run has begun; Lightning's spellings (``accelerator="gpu"``, ``devices="auto"`` or ``-1``, ``max_time`` as
``"DD:HH:MM:SS"``, a DataModule passed where the dataloaders go) become the one form the rest of trainkit reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from trainkit.activation import resolve_mode
from trainkit.callbacks.base import Callback
from trainkit.callbacks.checkpointing import ModelCheckpoint
from trainkit.callbacks.profiler import make_profiler
from trainkit.callbacks.progress import ProgressBar
from trainkit.callbacks.telemetry import Telemetry
from trainkit.callbacks.throughput import ThroughputMonitor
from trainkit.callbacks.timer import Timer, parse_duration
from trainkit.data import DataModule
from trainkit.errors import ConfigurationError
from trainkit.loggers import Logger, TensorBoardLogger
from trainkit.loops import check_val_schedule
from trainkit.module import TrainModule


def check(args: Mapping[str, Any]) -> None:
    """Refuse a Trainer argument the run cannot keep; ``args``: the constructor's arguments by name."""
    if args["accumulate_grad_batches"] < 1:
        raise ValueError(f"accumulate_grad_batches must be >= 1; got {args['accumulate_grad_batches']}.")
    if args["gradient_clip_algorithm"] not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value'; got {args['gradient_clip_algorithm']!r}.")
    if args["gradient_clip_val"] is not None and args["gradient_clip_val"] <= 0:
        raise ValueError(f"gradient_clip_val must be positive; got {args['gradient_clip_val']}.")
    if args["log_every_n_steps"] < 1:
        raise ValueError(f"log_every_n_steps must be >= 1; got {args['log_every_n_steps']}.")
    check_val_schedule(args["val_check_interval"], args["check_val_every_n_epoch"])
    if args["num_nodes"] < 1:
        raise ValueError(f"num_nodes must be >= 1; got {args['num_nodes']}.")
    max_steps, max_epochs = args["max_steps"], args["max_epochs"]
    if max_steps < -1 or (max_epochs is not None and max_epochs < 0):
        raise ValueError(f"max_steps must be >= -1 and max_epochs >= 0; got {max_steps}, {max_epochs}.")
    for name in ("min_steps", "min_epochs"):
        if args[name] is not None and (isinstance(args[name], bool) or args[name] < 0):
            raise ConfigurationError(f"{name}={args[name]!r}: use an int >= 0 (or None for no minimum).")
    if args["float32_matmul_precision"] not in (None, "highest", "high", "medium"):
        raise ValueError(f"float32_matmul_precision must be 'highest', 'high' or 'medium'; got "
                         f"{args['float32_matmul_precision']!r}.")
    if args["peer_timeout_s"] < 0:
        raise ValueError(f"peer_timeout_s must be >= 0 (0 turns the heartbeat off); got {args['peer_timeout_s']}.")
    if args["activation_checkpointing"] is not None:
        resolve_mode(args["activation_checkpointing"])  # an unknown mode fails here
    every = args["activation_checkpointing_every"]
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"activation_checkpointing_every={every!r} must be a positive integer (1: every selected "
                         "module).")
    for name in ("compile", "sync_batchnorm", "inference_mode"):
        if not isinstance(args[name], bool):
            raise TypeError(f"{name} must be True or False; got {args[name]!r}.")
    if args["benchmark"] is not None and not isinstance(args["benchmark"], bool):
        raise TypeError(f"benchmark must be True, False or None (leave torch's setting); got {args['benchmark']!r}.")
    reload = args["reload_dataloaders_every_n_epochs"]
    if isinstance(reload, bool) or not isinstance(reload, int) or reload < 0:
        raise ConfigurationError(f"reload_dataloaders_every_n_epochs={reload!r}: use an int >= 0 (0: never reload).")
    overfit = args["overfit_batches"]
    if isinstance(overfit, bool) or not ((isinstance(overfit, int) and overfit >= 0)
                                         or (isinstance(overfit, float) and 0.0 <= overfit <= 1.0)):
        raise ConfigurationError(f"overfit_batches={overfit!r}: use an int >= 0 (that many batches) or a float in "
                                 "[0, 1] (that fraction of the training and validation data); 0 turns it off.")


def set_backends(benchmark: bool | None, deterministic: bool, float32_matmul_precision: str | None) -> None:
    """torch's process-wide switches, as Lightning sets them when its Trainer is built: ``benchmark`` is
    ``torch.backends.cudnn.benchmark`` (None keeps the session's value, or False under ``deterministic``)."""
    if benchmark and deterministic:
        rank_zero_warn("benchmark=True with deterministic=True: cuDNN's autotuner may pick nondeterministic "
                       "algorithms, and torch ignores cudnn.deterministic while it runs; pass benchmark=False.")
    if benchmark is not None or deterministic:
        torch.backends.cudnn.benchmark = bool(benchmark)
    if float32_matmul_precision is not None:
        torch.set_float32_matmul_precision(float32_matmul_precision)


def resolve_accelerator(accelerator: str) -> str:
    """``accelerator`` as trainkit names it: Lightning's ``"gpu"`` is the machine's GPU kind, CUDA here."""
    if accelerator != "gpu":
        return accelerator
    if not torch.cuda.is_available():
        raise ConfigurationError("accelerator='gpu' asks for a CUDA GPU, and torch.cuda.is_available() is False on "
                                 "this machine: pass accelerator='cpu' (--trainer.accelerator cpu), or 'auto' to use a "
                                 "GPU where there is one.")
    return "cuda"


def resolve_devices(devices: int | str | list[int], accelerator: str) -> int:
    """Processes on this machine for ``devices``: a count; ``"auto"`` or ``-1`` (Lightning's "every device"): every
    visible GPU under CUDA, 1 on the CPU, which is one device (Lightning makes ``-1`` an error there); a string of
    digits is the count, ``"0,1"`` a list; a list ``[0, ..., n-1]`` is ``n`` (local rank i runs on GPU i)."""
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto" or re.fullmatch(r"-?\d+", text):
            devices = text if text == "auto" else int(text)
        elif re.fullmatch(r"\d+(\s*,\s*\d+)*\s*,?", text):
            devices = [int(part) for part in text.split(",") if part.strip()]
        else:
            raise ConfigurationError(f"devices={devices!r}: use a number of processes, 'auto' or -1 (every GPU; 1 on "
                                     "the CPU), or GPU indices such as [0, 1].")
    cuda = accelerator != "cpu" and (accelerator == "cuda" or torch.cuda.is_available())
    if devices == "auto" or devices == -1:
        return max(torch.cuda.device_count(), 1) if cuda else 1
    if isinstance(devices, list | tuple):
        if not cuda:
            raise ConfigurationError(f"devices={list(devices)}: GPU indices need accelerator 'cuda' (or 'gpu'); on the "
                                     f"CPU pass a number of processes (devices={max(len(devices), 1)}).")
        if list(devices) != list(range(len(devices))) or not devices:
            raise ConfigurationError(
                f"devices={list(devices)}: trainkit runs local rank i on GPU i, so it takes the first n GPUs "
                f"([0, ..., n-1]). To use GPUs {','.join(map(str, devices))}, set CUDA_VISIBLE_DEVICES="
                f"{','.join(map(str, devices))} and pass devices={len(devices)}.")
        return len(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be >= 1, 'auto' or -1 (every GPU); got devices={devices!r}.")
    return devices


def parse_max_time(max_time: str | timedelta | Mapping[str, int] | None) -> float | None:
    """``max_time`` in seconds (None: no limit), in any form Lightning's ``Timer`` takes (``parse_duration``)."""
    return None if max_time is None else parse_duration(max_time)


def run_module(fn: str, model: Any, connected: TrainModule | None, ckpt_path: str | Path | None
               ) -> tuple[TrainModule, str | Path | None]:
    """The module a run uses, and its ``ckpt_path``. Lightning's ``model=None`` (``trainer.test(ckpt_path="best")``)
    is the module of the trainer's last run (its fit's); with no ``ckpt_path`` either, Lightning 2.x loads the best
    checkpoint of that fit and says so, and so does this."""
    if model is None and fn != "fit" and connected is not None:
        if ckpt_path is None:
            rank_zero_warn(f"`.{fn}(ckpt_path=None)` was called without a model: the best checkpoint of the previous "
                           f"fit is used. Pass `.{fn}(ckpt_path='best')` to use the best model or `.{fn}(ckpt_path="
                           "'last')` to use the last one; a value silences this warning.")
            ckpt_path = "best"
        return connected, ckpt_path
    if model is None:
        fix = "pass the module" if fn == "fit" else "pass the module, or fit it first (with no model, validate, test " \
            "and predict use the module of the trainer's last run, as Lightning's do)"
        raise TypeError(f"Trainer.{fn}() was given no model and this Trainer has run none: {fix}: "
                        f"trainer.{fn}(model, ...).")
    if not isinstance(model, TrainModule):
        raise TypeError(f"Trainer.{fn} needs a TrainModule; got {type(model).__name__}.")
    return model, ckpt_path


def split_datamodule(fn: str, train: Any, evaluation: Any, datamodule: DataModule | None
                     ) -> tuple[Any, Any, DataModule | None]:
    """Lightning's ``trainer.fit(model, dm)``: a DataModule passed where the dataloaders go (fit's
    ``train_dataloaders``, the others' ``dataloaders``) is the datamodule. Returns ``train, evaluation, datamodule``."""
    slot = train if fn == "fit" else evaluation
    if isinstance(slot, DataModule):
        if datamodule is not None:
            raise ConfigurationError(f"Trainer.{fn} got two DataModules ({type(slot).__name__} in place of the "
                                     f"dataloaders and datamodule={type(datamodule).__name__}): pass one.")
        datamodule = slot
        train, evaluation = (None, evaluation) if fn == "fit" else (train, None)
    if datamodule is not None and (train is not None or evaluation is not None):
        raise ConfigurationError(f"Trainer.{fn} got dataloaders and a datamodule: pass one or the other (the "
                                 "DataModule's *_dataloader methods supply the loaders).")
    return train, evaluation, datamodule


def resolve_loggers(logger: bool | Logger | Sequence[Logger] | None, root: Path) -> list[Logger]:
    """``logger``: True for TensorBoard under ``root/runs``, False or None for none, or loggers."""
    if logger is True:
        return [TensorBoardLogger(root / "runs")]
    if logger is False or logger is None:
        return []
    return list(logger) if isinstance(logger, Sequence) else [logger]


def callbacks(given: Sequence[Callback] | None, checkpointing: bool, progress_bar: bool, telemetry: bool,
              profiler: str | None, max_time: float | None) -> tuple[list[Callback], Callback | None]:
    """The run's callbacks: ``given``, then the defaults it lacks (a ModelCheckpoint, the progress bar, telemetry
    and throughput where there is a logger, the profiler, a ``Timer`` for ``max_time``), and the profiler."""
    out = list(given or [])
    defaults: list[tuple[bool, type[Callback], Callable[[], Callback]]] = [
        (checkpointing, ModelCheckpoint, ModelCheckpoint), (progress_bar, ProgressBar, ProgressBar),
        (telemetry, Telemetry, Telemetry), (telemetry, ThroughputMonitor, ThroughputMonitor),
        (max_time is not None, Timer, lambda: Timer(timedelta(seconds=max_time or 0)))]
    for wanted, kind, make in defaults:
        if wanted and not any(isinstance(c, kind) for c in out):
            out.append(make())
    made = make_profiler(profiler)
    if made is not None:
        out.append(made)
    keys = [c.state_key for c in out]
    if len(keys) != len(set(keys)):
        raise ValueError(f"Callbacks need distinct state_key values to be checkpointed; got {keys}.")
    return out, made
