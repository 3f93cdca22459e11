"""Hook dispatch: the module's hooks and the callbacks', bound once per run.

A hook that neither the module nor any callback overrides costs nothing: the dispatch lists hold only
the methods a subclass actually defines, the module's first, then the callbacks' in order (each called
with ``(trainer, module, ...)`` prepended).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trainkit.callbacks.base import Callback
from trainkit.hooks import HOOK_NAMES, ModelHooks


class HookDispatch:
    """Bound hooks per name for one run of ``module`` with ``callbacks`` under ``trainer`` (the module's own
    hooks count when it is a ``TrainModule``; callbacks receive it either way)."""

    def __init__(self, trainer: Any, module: Any = None, callbacks: Sequence[Callback] = (),
                 timer: Any = None) -> None:
        self._table: dict[str, list[Callable]] = {}
        self._module_count: dict[str, int] = {}  # how many of a name's hooks are the module's (0 or 1)
        for name in HOOK_NAMES:
            fns: list[Callable] = []
            if isinstance(module, ModelHooks) and getattr(type(module), name) is not getattr(ModelHooks, name):
                fns.append(getattr(module, name))
            self._module_count[name] = len(fns)
            for cb in callbacks:
                if getattr(type(cb), name) is not getattr(Callback, name) and cb is not timer:
                    method = getattr(cb, name)
                    fns.append(lambda *a, _m=method: _m(trainer, module, *a))
            if timer is not None:  # a profiler times every call (``timer.timed(label, fn)``)
                owners = ["module"] * self._module_count[name] + [
                    type(cb).__name__ for cb in callbacks
                    if getattr(type(cb), name) is not getattr(Callback, name) and cb is not timer]
                fns = [timer.timed(f"{owner}.{name}", fn) for owner, fn in zip(owners, fns, strict=True)]
                if getattr(type(timer), name) is not getattr(Callback, name):  # the profiler's own hooks, untimed
                    method = getattr(timer, name)
                    fns.append(lambda *a, _m=method: _m(trainer, module, *a))
            self._table[name] = fns

    def fns(self, name: str) -> list[Callable]:
        """The bound hooks of ``name`` (module first), for loops that call them per batch."""
        return self._table[name]

    def __call__(self, name: str, *args: Any) -> None:
        for fn in self._table[name]:
            fn(*args)

    def module(self, name: str, *args: Any) -> None:
        """The module's hook only."""
        for fn in self._table[name][: self._module_count[name]]:
            fn(*args)

    def callbacks(self, name: str, *args: Any) -> None:
        """The callbacks' hooks only."""
        for fn in self._table[name][self._module_count[name] :]:
            fn(*args)
