"""Small helpers shared across trainkit."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch


def infer_batch_size(batch: Any) -> int:
    """Leading dimension of the first tensor found in a batch (0 when there is none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            size = infer_batch_size(item)
            if size:
                return size
    return 0


def jsonable(value: Any) -> Any:
    """``value`` made JSON-safe for meta.json: containers recursively, scalars kept, tensors as numbers
    or lists (strings when large), anything else as its repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return value.item()
        return value.tolist() if value.numel() <= 1024 else repr(value)
    return repr(value)


def stored_as_repr(value: Any) -> bool:
    """Whether ``jsonable`` keeps ``value``, or a part of it, only as its repr (text no constructor takes back)."""
    if value is None or isinstance(value, bool | int | float | str):
        return False
    if isinstance(value, dict):
        return any(stored_as_repr(v) for v in value.values())
    if isinstance(value, list | tuple | set):
        return any(stored_as_repr(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.numel() > 1024
    return True


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def model_summary(module: torch.nn.Module) -> str:
    """A table of the module's top-level children with their parameter counts (tied ones once)."""
    rows = [(name, type(child).__name__, sum(p.numel() for p in child.parameters()))
            for name, child in module.named_children()]
    width = max([len(r[0]) for r in rows] + [4])
    kind = max([len(r[1]) for r in rows] + [4])
    lines = [f"  | {'Name':<{width}} | {'Type':<{kind}} | Params"]
    lines += [f"{i} | {n:<{width}} | {t:<{kind}} | {_count(c)}" for i, (n, t, c) in enumerate(rows)]
    params = list(module.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    lines.append(f"{_count(trainable)} trainable, {_count(total - trainable)} frozen, {_count(total)} total parameters")
    return "\n".join(lines)


def tensor_cores_idle(device: torch.device) -> bool:
    """fp32 products on ``device`` would run without tensor cores that could take them: an Ampere-or-newer GPU
    (compute capability 8.0 and up) with the fp32 matmul precision at "highest"."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
            and torch.get_float32_matmul_precision() == "highest")


def print_results(fn: str, metrics: dict[str, float], on_this_rank: bool = True) -> None:
    """``validate``/``test`` results as a table of metrics (``on_this_rank``: rank 0 prints)."""
    if not on_this_rank or not metrics:
        return
    width = max(len(k) for k in metrics)
    lines = [f"{fn} results"] + [f"  {k:<{width}}  {v:.6g}" for k, v in sorted(metrics.items())]
    print("\n".join(lines))


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a bound ``*_step`` method takes ``batch_idx`` after the batch: Lightning passes it only then (a
    parameter named so, a second positional one, or ``*args``). Asked once per run, never per batch."""
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):  # no signature to read: call it as Lightning documents the step
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (any(p.name == "batch_idx" for p in params) or len(positional) >= 2
            or any(p.kind is p.VAR_POSITIONAL for p in params))
