"""The default CPU generator's states around a recording's random calls, worked out when first needed (see
``recorder.py``'s docstring), and the draws made on scratch tensors for the generator's sake alone."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:
    from trainkit_strategies.init.recorder import _Call


def generator_state() -> Tensor:
    """The default CPU generator's state (read past torch.get_rng_state, which a recording wraps)."""
    return torch.default_generator.get_state()


class Chain:
    """The default CPU generator's state before and after each random call a recording logged, worked out when first
    needed (see the module docstring). ``left``: the state the generator was left in (it has not drawn since);
    ``last``: the latest random call drawn from it while recording, not yet caught up with (None: none)."""

    def __init__(self, calls: list[_Call]) -> None:
        self.calls = calls
        self.after: dict[int, Tensor] = {}
        self.left = generator_state()
        self.last: int | None = None
        self.quiet = False  # running calls for their draws: the recorder lets them through unlogged

    def advance(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Run a random call on scratch tensors for its draws alone (``_advance``; a large one ``PIECE`` numbers at
        a time), unseen by the recorder."""
        self.quiet = True
        try:
            if not _drawn_in_pieces(func, args, kwargs):
                _advance(func, args, kwargs)
        finally:
            self.quiet = False

    def add(self, call: _Call) -> None:
        """Place a random call on the default generator in the chain: after the previous one, unless the
        generator was moved since (seeded, set, or drawn from outside the recording): then from where it stands."""
        now = generator_state()
        if self.last is None or not torch.equal(now, self.left):
            call.rng[0] = now
        else:
            call.prev = self.last
        self.left, self.last = now, call.index

    def before(self, call: _Call) -> Tensor:
        return call.rng[0] if call.prev is None else self.after_of(call.prev)

    def after_of(self, index: int) -> Tensor:
        """The state after call ``index``: calls whose state after is not known yet are run on scratch tensors, in
        order, from the latest known state (one scratch tensor at a time)."""
        pending = []
        while index not in self.after:
            pending.append(index)
            if self.calls[index].prev is None:
                break
            index = self.calls[index].prev
        if pending:
            saved = generator_state()
            for i in reversed(pending):
                call = self.calls[i]
                torch.default_generator.set_state(self.before(call))
                self.advance(call.func, call.args, call.kwargs)
                self.after[i] = generator_state()
            torch.default_generator.set_state(saved)
        return self.after[pending[0] if pending else index]

    def catch_up(self) -> None:
        """Bring the generator to where one process would have it now (before it is read, set or drawn from for
        real, and when the model is materialised)."""
        if self.last is not None:
            if torch.equal(generator_state(), self.left):
                torch.default_generator.set_state(self.after_of(self.last))
            else:
                rank_zero_warn("The default random generator was seeded or drawn from (not through torch's functions) "
                               "while configure_model's draws were left for the strategy's setup: the draws made "
                               "after configure_model's differ from a one-process run.")
            self.left, self.last = generator_state(), None

    def moved(self) -> None:
        """The generator was seeded or set while recording: the next draw starts from where it stands."""
        self.left, self.last = generator_state(), None


def _advance(func: Any, args: tuple, kwargs: dict) -> None:
    """Run a random call on scratch CPU tensors of its meta arguments' shapes, for the draws alone: the tensor it
    writes is left uninitialised (its values are drawn over), any other is zeros."""
    written = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.is_meta), None)
    inplace = getattr(func, "__name__", "").endswith("_")

    def scratch(t: Tensor) -> Tensor:
        make = torch.empty if inplace and t is written else torch.zeros
        return make(t.shape, dtype=t.dtype, device="cpu")

    with torch.device("cpu"), torch.no_grad():
        func(*tree_map(partial(on_cpu, scratch), args), **tree_map(partial(on_cpu, scratch), kwargs))


# what the generator draws for each function that fills a tensor with uniform or normal numbers, as torch.nn.init
# implements them (their other arguments only scale the numbers)
_PRIMITIVE = {"uniform_": "uniform_", "kaiming_uniform_": "uniform_", "xavier_uniform_": "uniform_",
              "trunc_normal_": "uniform_", "normal_": "normal_", "kaiming_normal_": "normal_",
              "xavier_normal_": "normal_"}
PIECE = 2**20  # numbers a large draw is made in on scratch, when the generator ends where the whole draw leaves it
_same_in_pieces: dict[tuple[Any, torch.dtype], bool] = {}


def _drawn_in_pieces(func: Any, args: tuple, kwargs: dict) -> bool:
    """Make the draws of a large uniform or normal fill ``PIECE`` numbers at a time on one scratch tensor (a draw
    nobody replays, made while the rank holds its share, then costs 4 MiB, not a whole tensor), where that leaves
    the generator where the whole fill does: checked once per function and dtype, on a small tensor. False where it
    does not apply (the caller then draws whole)."""
    primitive = _PRIMITIVE.get(getattr(func, "__name__", ""))
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    if primitive is None or len(tensors) != 1 or tensors[0].numel() <= 2 * PIECE \
            or not tensors[0].is_floating_point():
        return False
    target, dtype = tensors[0], tensors[0].dtype
    if (func, dtype) not in _same_in_pieces:
        small = partial(tree_map, lambda t: torch.empty(515, 16, dtype=dtype) if t is target else t)  # 8240 numbers
        saved = generator_state()
        try:
            with torch.device("cpu"), torch.no_grad():
                func(*small(args), **small(kwargs))
                whole = generator_state()
                torch.default_generator.set_state(saved)
                _draw(primitive, 515 * 16, 4096, dtype)  # 4096, 4096, 48
                _same_in_pieces[func, dtype] = torch.equal(whole, generator_state())
        except Exception:  # a function that takes no 2-d tensor: drawn whole
            _same_in_pieces[func, dtype] = False
        finally:
            torch.default_generator.set_state(saved)
    if _same_in_pieces[func, dtype]:
        _draw(primitive, target.numel(), PIECE, dtype)
    return _same_in_pieces[func, dtype]


def _draw(primitive: str, numel: int, piece: int, dtype: torch.dtype) -> None:
    """``numel`` numbers drawn by ``primitive`` (``uniform_``, ``normal_``) ``piece`` at a time, none shorter than
    16 (a normal fill of fewer draws differently)."""
    scratch = torch.empty(min(numel, piece), dtype=dtype, device="cpu")
    while numel > 0:
        take = min(piece, numel)
        if 0 < numel - take < 16:
            take = numel - 16
        getattr(scratch[:take], primitive)()
        numel -= take


def on_cpu(meta_tensor: Callable[[Tensor], Tensor], x: Any) -> Any:
    """A call argument moved off the meta device: a meta tensor through ``meta_tensor``, the meta device
    to the CPU, anything else as it is."""
    if isinstance(x, Tensor) and x.is_meta:
        return meta_tensor(x)
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x
