"""Record what ``configure_model`` does on the meta device, and replay it for one tensor at a time.

Every strategy that builds on meta (``BuildsOnMeta``) builds the model there so no rank holds more than its
part. Meta tensors have no values, so whatever ``configure_model`` computed (the modules' default
``reset_parameters``, a custom ``nn.init.normal_`` loop, ``nn.Parameter(torch.ones(d))``,
a ``torch.tril`` mask buffer) would be lost.
``InitRecorder`` is a ``TorchFunctionMode`` that logs every call touching a meta tensor: the op, its
arguments, which storages it wrote, and, for ops that draw random numbers, where the generator they draw from
stood just before.

``Replayer.fill(tensor, out)`` then rebuilds one tensor on the CPU: it re-runs the op that created its
storage (after rebuilding that op's meta inputs as they were at that moment), then every later op that
wrote into the storage, restoring the generator's state before each random op; a write that a later one overwrites
whole (a module's ``reset_parameters`` draw that the model's own init replaces) is skipped. So a parameter
gets the very values a one-process run gives it, while only the tensors it depends on exist at once.

The default CPU generator's states are worked out when first needed, not while recording (``Chain``): the state
before a random op is the state after the one before it, so a rank that replays the draws in their order draws each
once, as one process does, instead of once to advance the generator while recording and again to replay. A random op
whose state nobody needs by then is run on a scratch tensor of its shape. Until ``Replayer.finish()`` (a strategy's
setup calls it) the generator stays where the recording found it; reading or setting its state while recording, or a
real draw, brings it up to date first. A ``generator=`` passed explicitly is advanced while recording, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from trainkit_strategies.init.draws import Chain, generator_state, on_cpu

# functions that draw from a generator (module functions, Tensor methods and torch.nn.init)
_RANDOM = {
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", "rand_like",
    "randn_like", "randint_like", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "orthogonal_", "sparse_", "dropout", "dropout_",
}
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty"}
_DETERMINISTIC_INIT = {"constant_", "ones_", "zeros_", "eye_", "dirac_"}
# in-place ops whose result does not depend on what the tensor held before (a whole tensor written by one of these
# makes every earlier write to it dead)
_OVERWRITES = {
    "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "zero_",
    "fill_", "copy_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "constant_", "ones_", "zeros_", "eye_", "dirac_", "orthogonal_", "sparse_",
}
_IGNORED = {"__get__", "__set__", "untyped_storage", "size", "dim", "stride", "storage_offset", "numel",
            "is_floating_point", "is_complex", "element_size", "nelement", "data_ptr", "__len__", "__repr__",
            "__format__", "requires_grad_", "is_contiguous", "get_device", "__hash__", "__eq__", "__bool__"}


def _makes_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _owns_storage(t: Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


@dataclass
class _Call:
    index: int
    func: Any
    args: tuple
    kwargs: dict
    out: Any
    writes: list[int]  # storages the call wrote in place
    rng: dict[int, Tensor] = field(default_factory=dict)  # id(generator) -> state before the call, where known
    default: bool = False  # it draws from the default CPU generator (its state before: ``rng[0]`` or ``Chain``)
    prev: int | None = None  # the default generator's previous draw, whose state after is this one's before

    def overwrites(self, key: int) -> bool:
        """The call writes all of storage ``key`` without reading it (nor another view of it)."""
        if getattr(self.func, "__name__", "") not in _OVERWRITES or key not in self.writes:
            return False
        tensors = [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, Tensor) and t.is_meta]
        return _owns_storage(tensors[0]) and all(_key(t) != key for t in tensors[1:])


class InitRecorder(TorchFunctionMode):
    """Log every call on meta tensors while active (see the module docstring).

    ``torch.nn.init``'s in-place functions are logged whole (they are wrapped while recording): some of
    them return early on meta tensors (``trunc_normal_``), and their random draws can depend on values.
    ``defer``: leave the default generator behind until ``Replayer.finish()`` (else it is caught up on exit).
    """

    def __init__(self, defer: bool = False) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.created: dict[int, int] = {}  # storage -> index of the call that created it
        self.generators: dict[int, torch.Generator] = {}
        self.chain = Chain(self.calls)
        self.defer = defer
        self._patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> InitRecorder:
        for name in dir(torch.nn.init):
            func = getattr(torch.nn.init, name)
            if name.endswith("_") and not name.startswith("_") and callable(func):
                self._patch(torch.nn.init, name, self._wrap(func))
        for owner in (torch, torch.random):  # the generator read or set while recording: caught up first
            for name in ("get_rng_state", "set_rng_state", "manual_seed", "seed"):
                self._patch(owner, name, _catching_up(getattr(owner, name), sets=name != "get_rng_state"))
        self.chain.moved()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, func in reversed(self._patched):
            setattr(owner, name, func)
        self._patched.clear()
        if not self.defer:
            self.chain.catch_up()

    def _patch(self, owner: Any, name: str, func: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, func)

    def _wrap(self, func: Any) -> Any:
        def init_function(*args: Any, **kwargs: Any) -> Any:
            leaves = tree_flatten((args, kwargs))[0]
            target = next((t for t in leaves if isinstance(t, Tensor)), None)
            # this thread's recorder: a library may have kept this function past its own (transformers copies
            # torch's at import)
            recorder = _recording()
            if target is None or not target.is_meta or recorder is None or recorder.chain.quiet:
                return func(*args, **kwargs)
            recorder._log(func, args, kwargs, leaves, target, random=func.__name__ not in _DETERMINISTIC_INIT)
            return target

        init_function.__name__ = func.__name__
        init_function.__wrapped__ = func
        return init_function

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _IGNORED or self.chain.quiet:
            return func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        if not any(isinstance(t, Tensor) and t.is_meta for t in leaves) and \
                torch.get_default_device().type != "meta" and not _makes_meta(kwargs):
            return func(*args, **kwargs)
        if name == "__deepcopy__" and type(args[0]) is Tensor:  # a clone: its memo would hold the copy itself
            return self._log(Tensor.clone, (args[0],), {}, [args[0]], None, random=False)
        return self._log(func, args, kwargs, leaves, None, random=name in _RANDOM)

    def _log(self, func: Any, args: tuple, kwargs: dict, leaves: list, result: Any, random: bool) -> Any:
        """Run (unless ``result`` is given) and record one call. ``leaves``: the flattened ``(args, kwargs)``."""
        name = getattr(func, "__name__", "")
        metas = [t for t in leaves if isinstance(t, Tensor) and t.is_meta]
        before = {_key(t) for t in metas}
        generators = [g for g in leaves if isinstance(g, torch.Generator)]
        real = random and not metas and (any(isinstance(t, Tensor) for t in leaves) or (
            kwargs.get("device") is not None and not _makes_meta(kwargs)))
        if real and not generators:  # a real draw from the default generator: as one process would make it
            self.chain.catch_up()
        rng = {id(g): g.get_state() for g in generators} if random else {}
        out = func(*args, **kwargs) if result is None else result
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_meta]
        if not metas and not outs:
            if real and not generators:
                self.chain.moved()
            return out
        inplace = result is not None or (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
        writes = [_key(metas[0])] if inplace and metas else []  # the first tensor argument is written
        index = len(self.calls)
        for t in outs:
            if _key(t) not in before and _key(t) not in self.created:
                self.created[_key(t)] = index
        call = _Call(index, func, *_pinned((args, kwargs, out)), writes, rng, default=random and not generators)
        self.calls.append(call)
        if call.default:
            self.chain.add(call)
        elif random:  # an explicit generator: advanced now, as the same call on real tensors would
            for g in generators:
                self.generators[id(g)] = g
            self.chain.advance(func, args, kwargs)
        return out


def _catching_up(func: Any, sets: bool) -> Any:
    """``func`` (torch's ``get_rng_state``, ``manual_seed``...) with the recording's generator caught up first."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        recorder = _recording()
        if recorder is not None and not recorder.chain.quiet:
            recorder.chain.catch_up()
        out = func(*args, **kwargs)
        if recorder is not None and sets:
            recorder.chain.moved()
        return out

    wrapped.__name__, wrapped.__wrapped__ = func.__name__, func
    return wrapped


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

    def finish(self) -> None:
        """Bring the default generator to where one process leaves it after ``configure_model``: call once the
        model is materialised (later calls do nothing)."""
        self.rec.chain.catch_up()

    def prepare(self, tensor: Tensor) -> None:
        """Work out the generator states ``fill(tensor, ...)`` needs (drawing on scratch tensors what it does not
        replay itself) before its caller allocates the tensor to fill: one whole tensor at a time."""
        calls: dict[int, _Call] = {}
        self._needed(_key(tensor), len(self.rec.calls), calls)
        for index in sorted(calls):
            if calls[index].default:
                self.rec.chain.before(calls[index])

    def fill(self, tensor: Tensor, out: Tensor, index: tuple | None = None) -> None:
        """Write ``tensor``'s value at the end of the recording into ``out`` (a real tensor of its shape), or, with
        ``index``, the part ``tensor[index]`` of it (a rank's slice of a whole parameter: ``out`` has its shape).

        Random draws are replayed on the CPU, where a one-process run makes them. A tensor that owns its
        whole storage, created empty (as modules create their parameters), is rebuilt in ``out`` itself
        when ``out`` is on the CPU; any other is rebuilt in a temporary CPU tensor first."""
        saved = {0: generator_state()} | {i: g.get_state() for i, g in self.rec.generators.items()}
        try:
            self.prepare(tensor)
            key = _key(tensor)
            created = self.rec.calls[self.rec.created[key]]
            in_place = index is None and _owns_storage(tensor) and getattr(created.func, "__name__", "") in _EMPTY \
                and out.device.type == "cpu" and out.dtype == tensor.dtype and out.is_contiguous()
            if in_place:
                self._storage_at(key, len(self.rec.calls), into=out.view(-1))
                return
            storage = self._storage_at(key, len(self.rec.calls))
            value = _view(storage, tensor)
            with torch.no_grad():
                out.copy_(value if index is None else value[index])
        finally:
            torch.default_generator.set_state(saved.pop(0))
            for i, state in saved.items():
                self.rec.generators[i].set_state(state)

    def _writers(self, key: int, time: int) -> tuple[list[_Call], bool]:
        """The calls before ``time`` whose writes storage ``key`` still shows, and whether the first of them
        overwrites it whole (then what the storage held before does not matter)."""
        created = self.rec.created[key]
        writers = [c for c in self.writers.get(key, []) if created < c.index < time]
        last = next((i for i in range(len(writers) - 1, -1, -1) if writers[i].overwrites(key)), None)
        return (writers, False) if last is None else (writers[last:], True)

    def _needed(self, key: int, time: int, calls: dict[int, _Call]) -> None:
        """Into ``calls``: every call that rebuilding storage ``key`` as of ``time`` runs."""
        writers, fresh = self._writers(key, time)
        run = writers if fresh else [self.rec.calls[self.rec.created[key]], *writers]
        for call in run:
            if call.index not in calls:
                calls[call.index] = call
                for t in tree_flatten((call.args, call.kwargs))[0]:
                    if isinstance(t, Tensor) and t.is_meta and _key(t) != key and _key(t) in self.rec.created:
                        self._needed(_key(t), call.index, calls)

    def _storage_at(self, key: int, time: int, into: Tensor | None = None) -> Tensor:
        """The storage ``key`` as a flat CPU tensor (``into`` when given: it starts empty), after every
        call before ``time`` that wrote it."""
        created = self.rec.calls[self.rec.created[key]]
        writers, fresh = self._writers(key, time)
        if into is not None:
            flat = into
        elif fresh:  # written whole later: an empty storage of its size will do
            meta = next(t for t in tree_flatten(created.out)[0] if isinstance(t, Tensor) and _key(t) == key)
            flat = torch.empty(meta.untyped_storage().nbytes() // meta.element_size(), dtype=meta.dtype)
        else:
            base = self._run(created, {})
            flat = _flat(next(t for t in tree_flatten(base)[0] if isinstance(t, Tensor)))
        for call in writers:
            self._run(call, {key: flat})
        return flat

    def _run(self, call: _Call, bound: dict[int, Tensor]) -> Any:
        """Run ``call`` on the CPU; meta arguments become their values at that moment (``bound`` storages
        are used as they are: the call writes into them)."""
        def value(x: Tensor) -> Tensor:
            key = _key(x)
            return _view(bound[key] if key in bound else self._storage_at(key, call.index), x)

        real = partial(on_cpu, value)
        args, kwargs = tree_map(real, call.args), tree_map(real, call.kwargs)
        if call.default:
            torch.default_generator.set_state(self.rec.chain.before(call))
        for i, state in call.rng.items():
            if i != 0:
                self.rec.generators[i].set_state(state)
        with torch.device("cpu"), torch.no_grad():
            out = call.func(*args, **kwargs)
        if call.default:
            self.rec.chain.after[call.index] = generator_state()
        return out


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
