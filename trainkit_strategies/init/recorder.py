"""Record what ``configure_model`` does on the meta device, and replay it for one tensor at a time.

Every strategy that builds on meta (``BuildsOnMeta``) builds the model there so no rank holds more than its
part. Meta tensors have no values, so whatever ``configure_model`` computed (the modules' default
``reset_parameters``, a custom ``nn.init.normal_`` loop, ``nn.Parameter(torch.ones(d))``,
a ``torch.tril`` mask buffer) would be lost.
``InitRecorder`` is a ``TorchFunctionMode`` that logs every call touching a meta tensor: the op, its
arguments, which storages it wrote, and, for ops that draw random numbers, the state of the CPU
generator (and of any ``generator=`` passed) just before; it also runs those random ops on a scratch
CPU tensor of the same shape, so the generators advance exactly as they would have in one process.

``Replayer.fill(tensor, out)`` then rebuilds one tensor on the CPU: it re-runs the op that created its
storage (after rebuilding that op's meta inputs as they were at that moment), then every later op that
wrote into the storage, restoring the recorded generator states before each random op. So a parameter
gets the very values a one-process run gives it, while only the tensors it depends on exist at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# functions that draw from a generator (module functions, Tensor methods and torch.nn.init)
_RANDOM = {
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", "rand_like",
    "randn_like", "randint_like", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "orthogonal_", "sparse_", "dropout", "dropout_",
}
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty"}
_DETERMINISTIC_INIT = {"constant_", "ones_", "zeros_", "eye_", "dirac_"}
_IGNORED = {"__get__", "__set__", "untyped_storage", "size", "dim", "stride", "storage_offset", "numel",
            "is_floating_point", "is_complex", "element_size", "nelement", "data_ptr", "__len__", "__repr__",
            "__format__", "requires_grad_", "is_contiguous", "get_device", "__hash__", "__eq__", "__bool__"}


def _makes_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class _Call:
    index: int
    func: Any
    args: tuple
    kwargs: dict
    out: Any
    writes: list[int]  # storages the call wrote in place
    rng: dict[int, Tensor] = field(default_factory=dict)  # id(generator) -> state before the call (0: default)


class InitRecorder(TorchFunctionMode):
    """Log every call on meta tensors while active (see the module docstring).

    ``torch.nn.init``'s in-place functions are logged whole (they are wrapped while recording): some of
    them return early on meta tensors (``trunc_normal_``), and their random draws can depend on values.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.created: dict[int, int] = {}  # storage -> index of the call that created it
        self.generators: dict[int, torch.Generator] = {}
        self._patched: dict[str, Any] = {}

    def __enter__(self) -> InitRecorder:
        for name in dir(torch.nn.init):
            func = getattr(torch.nn.init, name)
            if name.endswith("_") and not name.startswith("_") and callable(func):
                self._patched[name] = func
                setattr(torch.nn.init, name, self._wrap(func))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, func in self._patched.items():
            setattr(torch.nn.init, name, func)
        self._patched.clear()

    def _wrap(self, func: Any) -> Any:
        def init_function(*args: Any, **kwargs: Any) -> Any:
            leaves = tree_flatten((args, kwargs))[0]
            target = next((t for t in leaves if isinstance(t, Tensor)), None)
            recorder = _recording()  # this thread's: a library may have kept this function past its recorder
            if target is None or not target.is_meta or recorder is None:  # (transformers copies torch's at import)
                return func(*args, **kwargs)
            recorder._log(func, args, kwargs, leaves, target, random=func.__name__ not in _DETERMINISTIC_INIT)
            return target

        init_function.__name__ = func.__name__
        init_function.__wrapped__ = func
        return init_function

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _IGNORED:
            return func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        if not any(isinstance(t, Tensor) and t.is_meta for t in leaves) and \
                torch.get_default_device().type != "meta" and not _makes_meta(kwargs):
            return func(*args, **kwargs)
        if name == "__deepcopy__" and type(args[0]) is Tensor:  # a clone: its memo would hold the copy itself
            return self._log(Tensor.clone, (args[0],), {}, [args[0]], None, random=False)
        return self._log(func, args, kwargs, leaves, None, random=name in _RANDOM)

    def _log(self, func: Any, args: tuple, kwargs: dict, leaves: list, result: Any, random: bool) -> Any:
        """Run (unless ``result`` is given) and record one call; advance the generators for a random one.
        ``leaves``: the flattened ``(args, kwargs)``."""
        name = getattr(func, "__name__", "")
        metas = [t for t in leaves if isinstance(t, Tensor) and t.is_meta]
        before = {_key(t) for t in metas}
        rng: dict[int, Tensor] = {}
        if random:
            rng[0] = torch.get_rng_state()
            for g in leaves:
                if isinstance(g, torch.Generator):
                    rng[id(g)] = g.get_state()
                    self.generators[id(g)] = g
        out = func(*args, **kwargs) if result is None else result
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_meta]
        if not metas and not outs:
            return out
        if random:  # advance the generators as the same call on real tensors would
            self._advance(func, args, kwargs)
        inplace = result is not None or (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
        writes = [_key(metas[0])] if inplace and metas else []  # the first tensor argument is written
        index = len(self.calls)
        for t in outs:
            if _key(t) not in before and _key(t) not in self.created:
                self.created[_key(t)] = index
        self.calls.append(_Call(index, func, *_pinned((args, kwargs, out)), writes, rng))
        return out

    @staticmethod
    def _advance(func: Any, args: tuple, kwargs: dict) -> None:
        scratch = partial(_on_cpu, lambda t: torch.zeros(t.shape, dtype=t.dtype, device="cpu"))
        with torch.device("cpu"):
            func(*tree_map(scratch, args), **tree_map(scratch, kwargs))


def _recording() -> InitRecorder | None:
    """The innermost ``InitRecorder`` active on this thread, if any."""
    from torch.overrides import _get_current_function_mode_stack

    return next((m for m in reversed(_get_current_function_mode_stack()) if isinstance(m, InitRecorder)), None)


def _pinned(tree: Any) -> Any:
    """``tree`` with its meta tensors as new tensor objects on the same storages: an axis that later cuts a
    parameter (``param.data = part``) changes that parameter's storage, not the one the log recorded."""
    with torch._C.DisableTorchFunction():
        return tree_map(lambda t: t.detach() if isinstance(t, Tensor) and t.is_meta else t, tree)


class Replayer:
    """Rebuild tensors created under an ``InitRecorder`` (see the module docstring)."""

    def __init__(self, recorder: InitRecorder) -> None:
        self.rec = recorder
        self.writers: dict[int, list[_Call]] = {}
        for call in recorder.calls:
            for key in call.writes:
                self.writers.setdefault(key, []).append(call)

    def knows(self, tensor: Tensor) -> bool:
        return tensor.is_meta and _key(tensor) in self.rec.created

    def fill(self, tensor: Tensor, out: Tensor, index: tuple | None = None) -> None:
        """Write ``tensor``'s value at the end of the recording into ``out`` (a real tensor of its shape), or, with
        ``index``, the part ``tensor[index]`` of it (a rank's slice of a whole parameter: ``out`` has its shape).

        Random draws are replayed on the CPU, where a one-process run makes them. A tensor that owns its
        whole storage, created empty (as modules create their parameters), is rebuilt in ``out`` itself
        when ``out`` is on the CPU; any other is rebuilt in a temporary CPU tensor first."""
        saved = {0: torch.get_rng_state()} | {i: g.get_state() for i, g in self.rec.generators.items()}
        try:
            key = _key(tensor)
            created = self.rec.calls[self.rec.created[key]]
            whole = tensor.storage_offset() == 0 and tensor.is_contiguous() and \
                tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
            in_place = index is None and whole and getattr(created.func, "__name__", "") in _EMPTY \
                and out.device.type == "cpu" and out.dtype == tensor.dtype and out.is_contiguous()
            if in_place:
                self._storage_at(key, len(self.rec.calls), into=out.view(-1))
                return
            storage = self._storage_at(key, len(self.rec.calls))
            value = _view(storage, tensor)
            with torch.no_grad():
                out.copy_(value if index is None else value[index])
        finally:
            torch.set_rng_state(saved.pop(0))
            for i, state in saved.items():
                self.rec.generators[i].set_state(state)

    def _storage_at(self, key: int, time: int, into: Tensor | None = None) -> Tensor:
        """The storage ``key`` as a flat CPU tensor (``into`` when given: it starts empty), after every
        call before ``time`` that wrote it."""
        created = self.rec.calls[self.rec.created[key]]
        if into is not None:
            flat = into
        else:
            base = self._run(created, {})
            flat = _flat(next(t for t in tree_flatten(base)[0] if isinstance(t, Tensor)))
        for call in self.writers.get(key, []):
            if created.index < call.index < time:
                self._run(call, {key: flat})
        return flat

    def _run(self, call: _Call, bound: dict[int, Tensor]) -> Any:
        """Run ``call`` on the CPU; meta arguments become their values at that moment (``bound`` storages
        are used as they are: the call writes into them)."""
        def value(x: Tensor) -> Tensor:
            key = _key(x)
            return _view(bound[key] if key in bound else self._storage_at(key, call.index), x)

        real = partial(_on_cpu, value)
        args, kwargs = tree_map(real, call.args), tree_map(real, call.kwargs)
        for i, state in call.rng.items():
            if i == 0:
                torch.set_rng_state(state)
            else:
                self.rec.generators[i].set_state(state)
        with torch.device("cpu"), torch.no_grad():
            return call.func(*args, **kwargs)


def _on_cpu(meta_tensor: Callable[[Tensor], Tensor], x: Any) -> Any:
    """A call argument moved off the meta device: a meta tensor through ``meta_tensor``, the meta device
    to the CPU, anything else as it is."""
    if isinstance(x, Tensor) and x.is_meta:
        return meta_tensor(x)
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def _view(flat: Tensor, like: Tensor) -> Tensor:
    """The view of ``flat`` (a real storage laid out flat, possibly itself a view at an offset) that the meta
    tensor ``like`` is of its storage."""
    return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + like.storage_offset())


def _flat(t: Tensor) -> Tensor:
    """A flat tensor over all of ``t``'s storage (so views at any offset can be taken from it)."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    if t.storage_offset() == 0 and t.is_contiguous() and t.numel() == numel:
        return t.reshape(-1)
    return t.as_strided((numel,), (1,), 0)
