"""``TrainModule.load_from_checkpoint``: a module rebuilt from a checkpoint's hyperparameters, with its weights.

Lightning's ``load_from_checkpoint`` (``core/saving.py``) in trainkit's terms: the module's ``__init__`` arguments
come from meta.json's ``hyperparameters`` (what ``save_hyperparameters`` recorded), overridden by keyword arguments;
``configure_model`` runs; then every parameter and persistent buffer is read whole from the universal checkpoint's
pieces, whichever strategy and world size wrote them (``trainkit_strategies.state.pieces.load_model``, the loader a
``single`` strategy resumes with), on one process and without a Trainer. As in Lightning, the module comes back in
training mode (``model.eval()`` is the caller's, before inference).
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from trainkit import checkpoint as ckpt
from trainkit.resume import checkpoint_in
from trainkit_strategies.state import pieces as st

if TYPE_CHECKING:
    from trainkit.module import TrainModule

M = TypeVar("M", bound="TrainModule")


def load_from_checkpoint(cls: type[M], path: str | Path, map_location: str | torch.device | None = None,
                         strict: bool = True, **kwargs: Any) -> M:
    """See ``TrainModule.load_from_checkpoint``."""
    if map_location is not None and not isinstance(map_location, str | torch.device):
        raise TypeError(f"map_location must be a device (\"cpu\", \"cuda:0\", a torch.device) or None; got "
                        f"{type(map_location).__name__}. A trainkit checkpoint records no device to remap: its "
                        "tensors are read on the host and the module is moved to map_location.")
    found = checkpoint_in(Path(path))
    if found is None:
        raise ckpt.CheckpointError(f"{path} holds a `latest` pointer but no complete checkpoint.")
    reader = ckpt.CheckpointReader(found)
    meta = reader.meta
    arguments = _init_arguments(cls, meta, kwargs, found)
    module = cls(**arguments)
    module.configure_model()
    module.on_load_checkpoint(meta.get("user", {}))
    _load_weights(module, reader, strict, meta, arguments)
    return module.to(map_location) if map_location is not None else module


def _init_arguments(cls: type, meta: dict[str, Any], overrides: dict[str, Any], path: Path) -> dict[str, Any]:
    """``__init__``'s arguments: the saved hyperparameters, then ``overrides``; keys ``__init__`` does not take are
    dropped unless it takes ``**kwargs`` (as Lightning's ``_load_state`` does)."""
    saved = dict(meta.get("hyperparameters") or {})
    as_text = [key for key in meta.get("hyperparameters_repr", []) if key in saved and key not in overrides]
    params = inspect.signature(cls.__init__).parameters
    named = {n: p for n, p in list(params.items())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    arguments = {**saved, **overrides}
    if not takes_any:
        arguments = {k: v for k, v in arguments.items() if k in named}
    call = f"{cls.__name__}.load_from_checkpoint({str(path)!r}, ...)"
    if as_text and any(key in arguments for key in as_text):
        listed = ", ".join(f"{key}=..." for key in as_text)
        raise TypeError(f"{path}'s hyperparameters {', '.join(map(repr, as_text))} were saved as text (their repr: "
                        f"they are not JSON values, a module or a class, say), so they cannot rebuild the module. "
                        f"Pass them: {call.removesuffix('...)')}{listed}).")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in arguments]
    if missing:
        recorded = "records none" if not saved else f"records only {', '.join(sorted(saved))}"
        raise TypeError(f"{cls.__name__}.__init__ needs {', '.join(missing)}, which {path} does not hold (its "
                        f"meta.json {recorded}). Call self.save_hyperparameters() in {cls.__name__}.__init__ so "
                        f"checkpoints record them, or pass them: "
                        f"{call.removesuffix('...)')}{', '.join(f'{n}=...' for n in missing)}).")
    return arguments


def _load_weights(module: torch.nn.Module, reader: ckpt.CheckpointReader, strict: bool, meta: dict[str, Any],
                  arguments: dict[str, Any]) -> None:
    """Every parameter and persistent buffer of ``module`` filled from the checkpoint's pieces, whole; without
    ``strict``, those in both, with a warning naming the rest (Lightning's ``strict=False``)."""
    tensors = [(n, p) for p, n in st.param_names(module).items()] + st.persistent_buffers(module)
    if not strict:
        stored = {k.removeprefix("model/") for k in reader.keys() if k.startswith("model/")}
        missing, unexpected = sorted({n for n, _ in tensors} - stored), sorted(stored - {n for n, _ in tensors})
        if missing:
            warnings.warn(f"Found keys that are in the model state dict but not in the checkpoint: {missing}",
                          stacklevel=3)
        if unexpected:
            warnings.warn(f"Found keys that are not in the model state dict but in the checkpoint: {unexpected}",
                          stacklevel=3)
        tensors = [(n, t) for n, t in tensors if n in stored]
    try:
        if strict:  # the loader a resuming ``single`` strategy uses: it names every tensor that does not fit, first
            layout = st.StateLayout({n: tuple(t.shape) for n, t in tensors},
                                    [st.whole_holder(n, t, True) for n, t in tensors], None, [], [])
            st.load_model(layout, reader)
        else:
            _load_present(tensors, reader)
    except st.StateMismatch as err:
        hint = ("Pass the arguments it was trained with as keyword arguments." if meta.get("hyperparameters") else
                "The checkpoint records no hyperparameters (call self.save_hyperparameters() in __init__ so that "
                "checkpoints do): pass the arguments it was trained with as keyword arguments.")
        raise ckpt.CheckpointError(f"{reader.path} was saved from another model than "
                                   f"{type(module).__name__}({_shown(arguments)}). {err}\n{hint}") from err


def _load_present(tensors: list[tuple[str, torch.Tensor]], reader: ckpt.CheckpointReader) -> None:
    """``tensors``, each of which the checkpoint holds, after checking their shapes (a shape that differs fails under
    ``strict=False`` too, as in ``load_state_dict``)."""
    stored = {name: tuple(reader.info(f"model/{name}")[0]) for name, _ in tensors}
    problems = [f"{name}: checkpoint shape {stored[name]}, model shape {tuple(t.shape)}" for name, t in tensors
                if stored[name] != tuple(t.shape)]
    if problems:
        raise st.StateMismatch(f"The checkpoint does not match the model ({len(problems)} problem(s)):\n  "
                               + "\n  ".join(problems[:20]))
    with torch.no_grad():
        for name, tensor in tensors:
            tensor.copy_(reader.full(f"model/{name}"))


def _shown(hparams: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in hparams.items())
    return text if len(text) <= 100 else text[:97] + "..."
