"""Batches as a pipeline sees them: cut into micro-batches along the first dimension of every tensor (structure
kept), each keyed by its signature (the shapes and dtypes that fix what a stage produces), and the module's pipeline
hooks that say what the first stage takes and what a loss counts."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn


def first_tensor(batch: Any) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else []
    for value in values:
        with contextlib.suppress(TypeError):
            return first_tensor(value)
    raise TypeError(f"pipeline: found no tensor in the batch ({type(batch).__name__}) to cut into micro-batches.")


def split_batch(batch: Any, parts: int) -> list[Any]:
    """The batch cut into ``parts`` along the first dimension of every tensor, structure kept."""
    if isinstance(batch, Tensor):
        return list(batch.tensor_split(parts))
    if isinstance(batch, Mapping):
        split = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    if isinstance(batch, list | tuple):
        split_items = [split_batch(v, parts) for v in batch]
        return [type(batch)(v[i] for v in split_items) for i in range(parts)]
    return [batch] * parts


def signature(batch: Any) -> tuple:
    """The shapes and dtypes of a micro-batch's tensors: what fixes the shapes a stage produces."""
    if isinstance(batch, Tensor):
        return (tuple(batch.shape), batch.dtype)
    if isinstance(batch, Mapping):
        return tuple((k, signature(v)) for k, v in batch.items())
    if isinstance(batch, list | tuple):
        return tuple(signature(v) for v in batch)
    return ()


def missing_hooks(module: nn.Module) -> list[str]:
    """The pipeline hooks ``module`` lacks of the two it must have."""
    return [name for name in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, name, None))]


def model_input(module: nn.Module, chunk: Any) -> Any:
    """What the first stage takes from a micro-batch: ``pipeline_input(chunk)``, or the batch's first element."""
    hook = getattr(module, "pipeline_input", None)
    if callable(hook):
        return hook(chunk)
    return chunk[0] if isinstance(chunk, list | tuple) else chunk


def loss_items(loss: Any, chunk: Any) -> tuple[Tensor, Tensor | int]:
    """The loss and how many items it averages: ``num_items`` when given, else the samples."""
    if isinstance(loss, Mapping):
        return loss["loss"], loss.get("num_items", first_tensor(chunk).shape[0])
    return loss, first_tensor(chunk).shape[0]
