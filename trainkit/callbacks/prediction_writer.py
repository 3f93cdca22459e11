"""PredictionWriter: every rank's ``predict_step`` outputs, merged into the dataset's order, in one safetensors file.

The file is what ``trainkit predict`` writes, and reads back with one line, never unpickling::

    predictions = safetensors.torch.load_file("predictions.safetensors")["predictions"]

A step's output is a tensor whose first dimension is the batch, or a dict, tuple or list of them (nested too); the
file holds one tensor per such leaf, every batch's rows concatenated: ``predictions`` for a plain tensor, the keys for
a dict (``"a.b"`` nested), ``"0"``, ``"1"``... for a tuple; with several predict dataloaders each key is prefixed by
``dataloader<i>/``. Rows are in the dataset's order wherever the loader's sampler says which sample each row is
(trainkit's sampler, a ``SequentialSampler``, torch's ``DistributedSampler``): every rank's rows are placed by their
sample index, and a sample predicted twice (a ``DistributedSampler``'s padding) is kept once, so the file is the same
at any world size. Other loaders' rows follow in the order predicted, rank 0's first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from trainkit.callbacks.base import Callback
from trainkit.data import ResumableSampler
from trainkit.errors import ConfigurationError
from trainkit.utils import infer_batch_size

if TYPE_CHECKING:
    from trainkit.module import TrainModule
    from trainkit.trainer import Trainer

FORMAT = "trainkit-predictions"


def sample_order(loader: Any) -> list[int] | None:
    """The dataset index of each sample ``loader`` yields, in order, where its sampler says (None where not)."""
    sampler = getattr(loader, "sampler", None)
    known = (ResumableSampler, SequentialSampler, DistributedSampler)
    if isinstance(loader, DataLoader) and loader.batch_size is not None and isinstance(sampler, known):
        return list(sampler)
    return None


def flatten(output: Any, where: str, prefix: str = "") -> dict[str, Tensor]:
    """``output``'s tensors by key (``predictions`` for a tensor, ``a.b`` for a nested dict, ``0`` for a tuple)."""
    if isinstance(output, Tensor):
        return {prefix or "predictions": output}
    if isinstance(output, Mapping):
        items = [(str(k), v) for k, v in output.items()]
    elif isinstance(output, list | tuple):
        items = [(str(i), v) for i, v in enumerate(output)]
    else:
        raise ConfigurationError(
            f"{where} returned {type(output).__name__}{f' under {prefix!r}' if prefix else ''}; a prediction written "
            "to a file is a tensor whose first dimension is the batch, or a dict, tuple or list of them. Return "
            "those, or write your own in a callback's on_predict_batch_end.")
    out: dict[str, Tensor] = {}
    for key, value in items:
        out |= flatten(value, where, f"{prefix}.{key}" if prefix else key)
    return out


class PredictionWriter(Callback):
    """Write every rank's ``predict_step`` outputs, in the dataset's order, to the safetensors file ``output`` (rank 0
    writes it once ``predict`` ends). See this module's docstring for the format.

    Args:
        output: the file to write (its directory is created; a file there is replaced).
    """

    def __init__(self, output: str | Path) -> None:
        self.output = Path(output)
        self._loaders: list[dict[str, Any]] = []  # per predict dataloader: rows, their sample indices, count seen
        self._error: str | None = None  # what this rank found wrong with the outputs, said on every rank at the end

    @property
    def state_key(self) -> str:
        return f"PredictionWriter[{self.output}]"

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._loaders, self._error = [], None

    def on_predict_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == 0:  # the loop numbers each loader's batches from 0, and skips a loader with none
            loaders = trainer.val_dataloaders
            while _batches(loaders[len(self._loaders)]) == 0:
                self._loaders.append(_entry(None))
            self._loaders.append(_entry(sample_order(loaders[len(self._loaders)])))
        where = f"{type(module).__name__}.predict_step (batch {batch_idx})"
        rows = {k: v.detach().cpu() for k, v in flatten(outputs, where).items()}
        samples = infer_batch_size(batch)
        for key, value in rows.items():
            if value.dim() == 0 or (samples and value.shape[0] != samples):
                self._error = self._error or (
                    f"{where} returned {key!r} of shape {tuple(value.shape)} for a batch of {samples} samples; a "
                    "prediction written to a file has the batch as its first dimension (one row per sample).")
                return  # said at the end, on every rank alike
        current = self._loaders[-1]
        current["rows"].append(rows)
        current["seen"] += next(iter(rows.values())).shape[0] if rows else 0

    def on_predict_end(self, trainer: Trainer, module: TrainModule) -> None:
        entries = self._loaders + [_entry(None)] * (len(trainer.val_dataloaders) - len(self._loaders))
        local = None
        if self._error is None:
            try:
                local = [self._local(entry) for entry in entries]
            except (RuntimeError, ValueError) as err:  # rows that do not concatenate (their shapes differ)
                self._error = f"The predictions of {type(module).__name__}.predict_step do not form one table: {err}"
        mine = (self._error, local)
        everyone = trainer.strategy.all_gather_object(mine) if trainer.world_size > 1 else [mine]
        errors = [error for error, _ in everyone if error is not None]
        if errors:  # every rank raises it, so none waits for the others
            raise ConfigurationError(errors[0])
        if not trainer.is_global_zero:
            return
        everyone = [rows for _, rows in everyone]
        tensors: dict[str, Tensor] = {}
        loaders = len(local)
        for i in range(loaders):
            merged = _merge([ranks[i] for ranks in everyone])
            tensors |= {(f"dataloader{i}/{k}" if loaders > 1 else k): v for k, v in merged.items()}
        samples = {v.shape[0] for v in tensors.values()}
        self.output.parent.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        tmp = self.output.with_name(f".{self.output.name}.tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": FORMAT})
        os.replace(tmp, self.output)
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
        print(f"Wrote the predictions of {' and '.join(map(str, sorted(samples))) or 0} samples to {self.output}"
              f"{f' ({shapes})' if shapes else ''}.", flush=True)

    @staticmethod
    def _local(entry: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows of one loader, concatenated, with the sample index of each (None where unknown)."""
        rows = entry["rows"]
        keys = list(rows[0]) if rows else []
        for i, batch in enumerate(rows):
            if list(batch) != keys:
                raise ConfigurationError(f"predict_step returned the keys {list(batch)} at batch {i} and {keys} at "
                                         "batch 0; every batch's prediction needs the same keys.")
        try:
            tensors = {k: torch.cat([batch[k] for batch in rows]) for k in keys}
        except RuntimeError as err:
            raise ConfigurationError(f"The predictions of different batches cannot be joined into one tensor ({err}); "
                                     "give every batch's prediction the same shape after its first dimension (pad "
                                     "sequences to one length).") from err
        order = entry["order"]
        return {"index": order[: entry["seen"]] if order is not None else None, "tensors": tensors}


def _entry(order: list[int] | None) -> dict[str, Any]:
    return {"order": order, "seen": 0, "rows": []}


def _batches(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _merge(parts: list[dict[str, Any]]) -> dict[str, Tensor]:
    """One loader's rows from every rank: by sample index, each sample once, where every rank knows its indices;
    otherwise rank by rank."""
    parts = [p for p in parts if p["tensors"]]
    if not parts:
        return {}
    keys = list(parts[0]["tensors"])
    joined = {k: torch.cat([p["tensors"][k] for p in parts]) for k in keys}
    if any(p["index"] is None for p in parts):
        return joined
    index = torch.tensor([i for p in parts for i in p["index"]])
    order = torch.sort(index, stable=True).indices
    ordered = index[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]  # a sample predicted on two ranks (padding) is kept once
    keep = order[first]
    return {k: v[keep] for k, v in joined.items()}
