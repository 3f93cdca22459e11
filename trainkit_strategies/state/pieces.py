"""Strategy state as flat ranges of named global tensors: the piece list universal checkpoints store.

Every strategy describes what its rank holds as ``Holder``s: a local tensor plus the ``Segment``s of
global tensors laid out in it. Replicated strategies hold each parameter whole (one segment covering
``[0, numel)``); sharded strategies hold a flat slice that may cover the tail of one parameter and the
head of the next. Saving emits one ``Piece`` per segment the rank owns; loading asks a reader for the
ranges each holder needs, whatever strategy or world size wrote them.

Keys: ``model/<name>`` for parameters (the fp32 master where one exists) and persistent buffers,
``optim/<name>/<state>`` for optimizer state (``exp_avg``, ``step``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

# Group entries that describe how this run executes the optimizer, not its numbers: never restored.
_EXECUTION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


@dataclass(frozen=True)
class Strided:
    """A tensor-parallel part of a global tensor, flattened: its element ``u`` is element
    ``(u // block) * stride + origin + u % block`` of the flattened whole. A row-parallel weight ``[out, in]`` split
    over ``t`` ranks is, on rank ``r``, ``Strided(r * in/t, in/t, in)``: ``out`` blocks of ``in/t`` elements, one per
    row; a column-parallel weight's part is one block (contiguous)."""

    origin: int
    block: int
    stride: int

    def index(self, u: int) -> int:
        return (u // self.block) * self.stride + self.origin + u % self.block


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of the flattened global tensor ``name`` (of its part ``strided``, where it is
    tensor-parallel), held at ``offset`` locally."""

    name: str
    start: int
    stop: int
    offset: int = 0
    strided: Strided | None = None


@dataclass
class Holder:
    """A local tensor holding one or more segments; ``write`` marks the rank that saves them."""

    tensor: Tensor
    segments: tuple[Segment, ...]
    write: bool = True


@dataclass(frozen=True)
class Piece:
    """One range of a global tensor, as written to a checkpoint file: elements ``[start, stop)`` of the flattened
    tensor, or of its tensor-parallel part ``strided``."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    stop: int
    data: Tensor
    strided: Strided | None = None


class Reader(Protocol):
    """What loading needs from a checkpoint: tensor metadata and ranges of flattened tensors."""

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype] | None: ...

    def read(self, key: str, start: int, stop: int, strided: Strided | None = None) -> Tensor: ...

    def keys(self) -> Iterable[str]: ...


@dataclass
class StateLayout:
    """Where this rank's model and optimizer state live, in terms of global parameter names."""

    shapes: dict[str, tuple[int, ...]]
    model: list[Holder]
    optimizer: Optimizer | None
    optimizer_holders: list[Holder]  # one per optimizer param, in param_groups order
    group_names: list[list[str]]  # the user's param groups as parameter names


def rename_holder(holder: Holder, rename: Callable[[str], str]) -> Holder:
    """The same holder with its segments' tensor names mapped (a pipeline stage's names to the model's)."""
    segments = tuple(Segment(rename(s.name), s.start, s.stop, s.offset, s.strided) for s in holder.segments)
    return Holder(holder.tensor, segments, holder.write)


def renamed_layout(layout: StateLayout, rename: Callable[[str], str], shapes: dict[str, tuple[int, ...]],
                   group_names: list[list[str]], elsewhere: Collection[str] = ()) -> StateLayout:
    """``layout`` of a part of a model (a pipeline stage) under the whole model's names and ``shapes``; a holder of
    only names in ``elsewhere`` (tensors another rank writes: a weight tied across stages) is read, not written."""

    def convert(holder: Holder) -> Holder:
        named = rename_holder(holder, rename)
        if named.segments and all(s.name in elsewhere for s in named.segments):
            return Holder(named.tensor, named.segments, False)
        return named

    return StateLayout(shapes=shapes, model=[convert(h) for h in layout.model], optimizer=layout.optimizer,
                       optimizer_holders=[convert(h) for h in layout.optimizer_holders], group_names=group_names)


def whole_holder(name: str, tensor: Tensor, write: bool) -> Holder:
    return Holder(tensor, (Segment(name, 0, tensor.numel()),), write)


def param_names(module: nn.Module) -> dict[Tensor, str]:
    """Parameter -> its first qualified name (tied parameters appear once, as in named_parameters)."""
    return {p: n for n, p in module.named_parameters()}


def persistent_buffers(module: nn.Module) -> list[tuple[str, Tensor]]:
    out = []
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf_name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    return out


def group_names_of(optimizer: Optimizer, names: dict[Tensor, str]) -> list[list[str]]:
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if p not in names]
        if missing:
            raise ValueError(
                f"Optimizer param group {i} holds tensors that are not parameters of the module "
                f"(shapes {missing[:3]}). Build the optimizer over model.parameters() in configure_optimizers."
            )
        groups.append([names[p] for p in group["params"]])
    return groups


def _plain(value: object) -> object:
    if isinstance(value, Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def group_hyperparameters(optimizer: Optimizer) -> list[dict]:
    return [{k: _plain(v) for k, v in g.items() if k not in _EXECUTION_KEYS} for g in optimizer.param_groups]


def collect_pieces(layout: StateLayout) -> list[Piece]:
    """The pieces this rank writes."""
    pieces: list[Piece] = []
    for holder in layout.model:
        if holder.write:
            pieces.extend(_pieces_of("model/", holder, holder.tensor, layout.shapes))
    if layout.optimizer is None:
        return pieces
    params = [p for g in layout.optimizer.param_groups for p in g["params"]]
    for param, holder in zip(params, layout.optimizer_holders, strict=True):
        if not holder.write:
            continue
        for state_key, value in layout.optimizer.state.get(param, {}).items():
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"Optimizer state {state_key!r} is a {type(value).__name__}; universal checkpoints store "
                    "tensors only."
                )
            if value.numel() == holder.tensor.numel() and value.dim() > 0:
                pieces.extend(_pieces_of("optim/", holder, value, layout.shapes, f"/{state_key}"))
            elif value.dim() == 0:
                for seg in holder.segments:
                    if seg.start == 0 and (seg.strided is None or seg.strided.origin == 0):
                        key = f"optim/{seg.name}/{state_key}"
                        pieces.append(Piece(key, (), value.dtype, 0, 1, value.detach().reshape(1).clone()))
            elif len(holder.segments) == 1 and holder.segments[0].start == 0:
                name = holder.segments[0].name
                flat = value.detach().reshape(-1)
                pieces.append(Piece(f"optim/{name}/{state_key}", tuple(value.shape), value.dtype, 0,
                                    flat.numel(), flat))
            else:
                raise ValueError(
                    f"Optimizer state {state_key!r} of shape {tuple(value.shape)} is neither parameter-shaped "
                    "nor a scalar, so it cannot be sharded; use an optimizer with elementwise state."
                )
    return pieces


def _pieces_of(prefix: str, holder: Holder, tensor: Tensor, shapes: dict, suffix: str = "") -> list[Piece]:
    flat = tensor.detach().reshape(-1)
    return [
        Piece(f"{prefix}{s.name}{suffix}", shapes[s.name], tensor.dtype, s.start, s.stop,
              flat[s.offset : s.offset + s.stop - s.start], s.strided)
        for s in holder.segments
    ]


def _fill(holder: Holder, target: Tensor, key_of, reader: Reader) -> None:
    flat = target.view(-1)
    for seg in holder.segments:
        chunk = reader.read(key_of(seg.name), seg.start, seg.stop, seg.strided)
        flat[seg.offset : seg.offset + seg.stop - seg.start].copy_(chunk)


class StateMismatch(ValueError):
    """A checkpoint's tensors do not fit the model (another architecture, or another configuration of it)."""


def check_compatible(layout: StateLayout, reader: Reader) -> None:
    """Fail early, naming the tensors, when the checkpoint was saved from a different model."""
    problems = []
    for name, shape in layout.shapes.items():
        info = reader.info(f"model/{name}")
        if info is None:
            problems.append(f"{name}: missing from the checkpoint")
        elif tuple(info[0]) != tuple(shape):
            problems.append(f"{name}: checkpoint shape {tuple(info[0])}, model shape {tuple(shape)}")
    extra = sorted(k[6:] for k in reader.keys() if k.startswith("model/") and k[6:] not in layout.shapes)
    problems += [f"{name}: in the checkpoint but not in the model" for name in extra]
    if problems:
        listed = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise StateMismatch(f"The checkpoint does not match the model ({len(problems)} problem(s)):\n  {listed}{more}")


def load_model(layout: StateLayout, reader: Reader) -> None:
    check_compatible(layout, reader)
    with torch.no_grad():
        for holder in layout.model:
            _fill(holder, holder.tensor, lambda n: f"model/{n}", reader)


def load_optimizer(layout: StateLayout, reader: Reader, groups: Sequence[dict]) -> None:
    """Rebuild optimizer state for the local holders and restore each group's hyperparameters."""
    optimizer = layout.optimizer
    if optimizer is None:
        return
    saved_names = [g["params"] for g in groups]
    if saved_names != layout.group_names:
        raise StateMismatch(
            "The checkpoint's optimizer param groups do not match this run's: the checkpoint has "
            f"{len(saved_names)} group(s) of sizes {[len(g) for g in saved_names]}, configure_optimizers built "
            f"{len(layout.group_names)} of sizes {[len(g) for g in layout.group_names]}."
        )
    state_keys: dict[str, list[str]] = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, _, state_key = key[6:].rpartition("/")
            state_keys.setdefault(name, []).append(state_key)
    torch_state: dict[int, dict[str, Tensor]] = {}
    for index, holder in enumerate(layout.optimizer_holders):
        names = [s.name for s in holder.segments]
        if not names:  # this rank's piece of the group is all padding: its state starts afresh, as it holds nothing
            continue
        keys = state_keys.get(names[0], [])
        if not keys:
            continue
        entry = {}
        for state_key in keys:
            shape, dtype = reader.info(f"optim/{names[0]}/{state_key}")
            if shape == ():
                entry[state_key] = reader.read(f"optim/{names[0]}/{state_key}", 0, 1).reshape(())
            elif math.prod(shape) == math.prod(layout.shapes[names[0]]):
                buf = torch.empty(holder.tensor.numel(), dtype=dtype, device=holder.tensor.device)
                _fill(holder, buf, lambda n, k=state_key: f"optim/{n}/{k}", reader)
                entry[state_key] = buf.view_as(holder.tensor)
            else:
                entry[state_key] = reader.read(f"optim/{names[0]}/{state_key}", 0, math.prod(shape)).view(shape)
        torch_state[index] = entry
    param_groups, index = [], 0
    for current, saved in zip(optimizer.param_groups, groups, strict=True):
        group = {k: v for k, v in current.items() if k != "params"}
        for k, v in saved.items():
            if k in _EXECUTION_KEYS or k not in group:
                continue
            group[k] = _like(v, group[k])
        group["params"] = list(range(index, index + len(current["params"])))
        index += len(current["params"])
        param_groups.append(group)
    optimizer.load_state_dict({"state": torch_state, "param_groups": param_groups})


def saved_group(saved: dict, params: list[Tensor], defaults: dict) -> dict:
    """A param group for ``optimizer.add_param_group``: ``params`` with the hyperparameters a checkpoint saved for it
    (``saved``, from ``group_hyperparameters``), each in the type of the optimizer's default (a tuple, a tensor)."""
    hyper = {k: _like(v, defaults.get(k)) for k, v in saved.items() if k not in _EXECUTION_KEYS}
    return {**hyper, "params": params}


def _like(value: object, current: object) -> object:
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(current, Tensor):
        return torch.as_tensor(value, dtype=current.dtype, device=current.device)
    return value


# -- ranges of strided parts ------------------------------------------------------------------------------------
# A range of a part (or of the whole) is, on the whole seen as rows of ``width`` elements, at most three rectangles:
# a partial first row, full rows, a partial last row. Two ranges intersect rectangle by rectangle, and each
# intersection is one strided copy (``as_strided``): no per-element index is ever built.


@dataclass(frozen=True)
class Rect:
    """Rows ``[row0, row1)`` x columns ``[col0, col1)`` of the whole as rows of some width; the range's element at
    ``(row0, col0)`` is its element ``base``, and the next row's is ``pitch`` further."""

    row0: int
    row1: int
    col0: int
    col1: int
    base: int
    pitch: int

    def at(self, row: int, col: int) -> int:
        return self.base + (row - self.row0) * self.pitch + (col - self.col0)


def rectangles(start: int, stop: int, strided: Strided | None, width: int) -> list[Rect]:
    """Elements ``[start, stop)`` of a part (``strided``, whose stride must be ``width``) or of the whole (None) as
    rectangles of the whole seen as rows of ``width`` elements."""
    if start >= stop:
        return []
    block, origin = (strided.block, strided.origin) if strided is not None else (width, 0)
    first, last = start // block, (stop - 1) // block
    head, tail = start % block, (stop - 1) % block + 1
    if first == last:
        return [Rect(first, first + 1, origin + head, origin + tail, start, block)]
    out = [Rect(first, first + 1, origin + head, origin + block, start, block)]
    if last > first + 1:
        out.append(Rect(first + 1, last, origin, origin + block, (first + 1) * block, block))
    out.append(Rect(last, last + 1, origin, origin + tail, last * block, block))
    return out


def overlaps(start: int, stop: int, strided: Strided | None, other_start: int, other_stop: int,
             other: Strided | None) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Where two ranges (each of a part or of the whole) hold the same elements of a tensor, as strided blocks:
    ``(rows, cols, index, pitch, other_index, other_pitch)``, ``index + i * pitch + j`` in the first range and
    ``other_index + i * other_pitch + j`` in the second being the same element for ``i < rows``, ``j < cols``."""
    if strided is not None and other is not None and strided.stride != other.stride:
        for rect in rectangles(start, stop, strided, strided.stride):  # each row of the first is contiguous
            for row in range(rect.row0, rect.row1):
                lo = row * strided.stride + rect.col0
                for rows, cols, i, pitch, j, other_pitch in overlaps(lo, lo + rect.col1 - rect.col0, None,
                                                                      other_start, other_stop, other):
                    yield rows, cols, rect.at(row, rect.col0) + i - lo, pitch, j, other_pitch
        return
    known = strided or other
    width = known.stride if known is not None else max(stop, other_stop)
    for a in rectangles(start, stop, strided, width):
        for b in rectangles(other_start, other_stop, other, width):
            r0, r1, c0, c1 = max(a.row0, b.row0), min(a.row1, b.row1), max(a.col0, b.col0), min(a.col1, b.col1)
            if r0 < r1 and c0 < c1:
                yield r1 - r0, c1 - c0, a.at(r0, c0), a.pitch, b.at(r0, c0), b.pitch
