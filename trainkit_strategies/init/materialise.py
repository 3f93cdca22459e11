"""Materialising a model built on the meta device: only what this rank keeps, straight where it is kept.

A strategy that builds on meta (``RecordsInit``) runs ``configure_model`` on the meta device while an
``InitRecorder`` (``recorder.py``) logs what the code computes. At setup the strategy says where each meta
parameter goes: into a unit's flat buffer (``homes``: ZeRO-3/FSDP, one unit at a time), or, for strategies that
keep whole parameters (ddp, ZeRO-1/2, zero_offload, single), into a tensor of its own on the device; ``parts`` (a
parameter -> the index of the whole tensor this rank keeps, ``whole[index]``) is how an axis that keeps a slice
says so. Each tensor gets the value a one-process run gives it: read from the module's ``tensor_source`` where it
has one (``trainkit.hf.CausalLM(pretrained=...)``: sliced reads of safetensors files), else replayed from the log
(custom ``nn.init`` calls, factories and random draws included), one whole tensor at a time on the host. So a
rank holds its part plus one tensor. A module whose tensors the log cannot rebuild falls back to its
``reset_parameters()`` (and the model's ``init_weights(module)`` if it has one), with a warning.

``tensor_source``, where the root module has one, is called as ``tensor_source(name, out, index)`` with a
parameter's or buffer's name in the root, the real tensor to fill and the index this rank keeps (None: whole); it
writes that part of the tensor into ``out`` and returns True, or False when it has no such tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.capabilities import BuildsOnMeta
from trainkit_strategies.init.recorder import InitRecorder, Replayer

Source = Callable[[str, Tensor, Any], bool]
CHUNK = 2**22  # elements (16 MiB of fp32) broadcast at a time while materialising


class RecordsInit(BuildsOnMeta):
    """What a strategy that builds on meta shares: the recording context, and materialising what is left on the
    meta device whole, straight on the strategy's device (its ``_place``). Mixed into a ``Strategy``."""

    _replayer: Replayer | None = None  # what configure_model computed on the meta device
    device: torch.device
    optimizer: Optimizer | None
    module: nn.Module | None
    comm: Any

    def init_context(self) -> contextlib.AbstractContextManager:
        return self._recording()

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        recorder = InitRecorder(defer=True)  # the generator caught up as the model is materialised (``_place``)
        with torch.device("meta"), recorder:
            yield
        self._replayer = Replayer(recorder)

    def _materialise_rest(self, module: nn.Module) -> None:
        """Every meta parameter and buffer of ``module``, whole, on the device with its one-process value (each
        parameter stays the same object: whatever holds it, the optimizer too, holds the real one)."""
        if self.device.type != "meta" and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            materialise_meta(module, self._replayer, self.device)

    def _place(self, module: nn.Module) -> None:
        self._materialise_rest(module)
        self._materialise_states(module)
        if self._replayer is not None:  # the random generator where one process leaves it after configure_model
            self._replayer.finish()
        super()._place(module)  # type: ignore[misc]

    def _materialise_states(self, module: nn.Module) -> None:
        """What a module's own ``_apply`` moves besides parameters and buffers (a torchmetrics ``Metric``'s states
        and their defaults), built on meta: on the device, with the values the recording gives them."""
        if self.device.type == "meta":
            return

        def real(t: Tensor) -> Tensor:
            if not t.is_meta:
                return t
            known = self._replayer is not None and self._replayer.knows(t)
            if known:
                self._replayer.prepare(t)
            out = torch.zeros(t.shape, dtype=t.dtype, device=self.device)
            if known:
                self._replayer.fill(t, out)
            return out

        for mod in module.modules():
            if type(mod)._apply is not nn.Module._apply:  # it moves more than parameters and buffers
                mod._apply(real)

    def _chunks(self, params: list[Tensor], offsets: list[int]) -> Iterator[tuple[int, Tensor]]:
        """Rank 0's value of each of ``params`` (laid out at ``offsets`` of a flat buffer) in chunks of 16 MiB,
        float32 on the device: (offset in the buffer, chunk). A meta parameter is rebuilt or read whole on the host
        first (``WholeValue``), so a caller that copies what it keeps of each chunk holds one whole tensor beside
        it, however large the buffer. One neither the log nor a file has is given its module's
        ``reset_parameters()`` values (the module whole, with a warning)."""
        assert self.module is not None
        whole = WholeValue(self.module, self._replayer)
        for p, offset in zip(params, offsets, strict=True):
            value = whole(p) if p.is_meta and self.device.type != "meta" else p.detach()
            if value is None:
                home = torch.empty(p.shape, device=self.device)
                materialise_meta(self.module, self._replayer, self.device, {p: home})
                value = p.detach()
            # planning on meta (``trainkit estimate``): an fp32 tensor moves without a copy, so whole is the same
            size = max(1, value.numel()) if value.is_meta and value.dtype == torch.float32 and \
                value.is_contiguous() else CHUNK
            for start, piece in _pieces(value, size):
                chunk = piece.to(self.device, torch.float32)
                self.comm.broadcast(chunk, src=0)  # every rank starts from rank 0's values
                yield offset + start, chunk

    def _point(self, params: list[Tensor], views: list[Tensor]) -> None:
        """Make ``params`` the ``views`` (their places in a flat buffer); a meta one is first replaced by a
        parameter of its own, which keeps its own version counter, not the buffer's."""
        for p, view in zip(params, views, strict=True):
            if p.is_meta and self.device.type != "meta":
                replace_parameter(p, view.new_empty(0))
            p.data, p.grad = view, None


def _pieces(value: Tensor, size: int) -> Iterator[tuple[int, Tensor]]:
    """``value`` flattened, in pieces of about ``size`` elements: (offset, piece). A view that is not contiguous (an
    axis's part of a whole) is copied a block of rows at a time, never whole."""
    if value.is_contiguous() or value.dim() < 2:
        flat = value.reshape(-1)
        for start in range(0, flat.numel(), size):
            yield start, flat[start : start + size]
        return
    rows = value.flatten(1) if value.dim() > 2 else value
    width = rows.shape[1]
    step = max(1, size // max(width, 1))
    for first in range(0, rows.shape[0], step):
        yield first * width, rows[first : first + step].reshape(-1)


def materialise_meta(root: nn.Module, replayer: Replayer | None, device: torch.device,
                     homes: dict[Tensor, Tensor] | None = None,
                     parts: dict[Tensor, tuple] | None = None) -> None:
    """Give meta parameters real storage and values, in place (``replace_parameter``: each stays the same object).

    ``homes`` (parameter -> its place in a unit's buffer): only modules with a meta parameter among them are
    materialised, their parameters placed there; None: every module's. A module is materialised once, all its
    parameters together, even those another unit shards (they get storage of their own, copied into their unit
    later). ``parts``: parameters this rank keeps a slice of (see the module docstring). Meta buffers of every
    module are materialised too.
    """
    homes = homes if homes is not None else {}
    parts = parts or {}
    source: Source | None = getattr(root, "tensor_source", None)
    names = {t: n for n, t in (*root.named_parameters(), *root.named_buffers())} if source is not None else {}
    whole: WholeValue | None = None  # made at the first part of a whole met
    for mod in root.modules():
        metas = {n: p for n, p in mod._parameters.items() if p is not None and p.is_meta}
        if not metas or (homes and not any(p in homes for p in metas.values())):
            continue
        buffers = {n: b for n, b in mod._buffers.items() if b is not None and b.is_meta}
        replay = replayer is not None and all(replayer.knows(_stand_in(t))
                                              for t in [*metas.values(), *buffers.values()])
        reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
        if not replay and reset is None:
            raise TypeError(
                f"{type(mod).__name__} was built on the meta device (in configure_model) in a way trainkit "
                "cannot replay, and has no reset_parameters() to initialise it; define reset_parameters() or "
                "build this module in __init__ instead of configure_model."
            )
        if not replay and replayer is not None:
            rank_zero_warn(f"{type(mod).__name__}'s tensors were computed in configure_model in a way trainkit "
                           "cannot replay; they are initialised by its reset_parameters() instead, so they "
                           "differ from a one-process run.")
        if replay and source is None:  # the draws it does not replay made first, before its tensors are allocated
            for t in [*metas.values(), *buffers.values()]:
                replayer.prepare(_stand_in(t))
        for old in metas.values():
            home = homes.get(old)
            shape = old[parts[old]] if old in parts else old
            data = home if home is not None else torch.empty_like(shape, device=device, dtype=torch.float32)
            replace_parameter(old, data)
        for name, buf in buffers.items():
            mod._buffers[name] = torch.empty_like(buf, device=device)
        olds = {**{(n, "p"): t for n, t in metas.items()}, **{(n, "b"): t for n, t in buffers.items()}}
        with torch.no_grad():
            if not replay:
                reset()
                custom = getattr(root, "init_weights", None)
                if callable(custom):  # the model's own initialisation, module by module
                    custom(mod)
            for (name, kind), old in olds.items():  # one tensor read or rebuilt at a time
                out = mod._parameters[name].data if kind == "p" else mod._buffers[name]
                meta = getattr(old, "_trainkit_meta", old)
                if hasattr(meta, "_trainkit_part"):
                    whole = whole or WholeValue(root, replayer)
                    value = whole(meta)
                    if value is not None:
                        out.copy_(value)
                    continue
                if _read(source, names, old, out, parts.get(old), meta):
                    continue
                if replay:
                    assert replayer is not None
                    replayer.fill(meta, out, parts.get(old))
    for mod in root.modules():  # buffers of modules without meta parameters
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros_like(buf, device=device)
                if _read(source, names, buf, mod._buffers[name], None):
                    continue
                if replayer is not None and replayer.knows(buf):
                    replayer.fill(buf, mod._buffers[name])


def replace_parameter(old: Tensor, data: Tensor) -> nn.Parameter:
    """``old`` (a meta parameter) made a parameter on ``data`` in place: the same object, so whatever holds it (its
    modules, tied ones too, an optimizer's groups, an axis's or an engine's bookkeeping made before setup) holds the
    real one. Its former self, the meta tensor the recorder knows, is kept as ``old._trainkit_meta``."""
    meta = nn.Parameter(data, requires_grad=old.requires_grad)
    torch.utils.swap_tensors(old, meta)  # ``meta`` now holds old's meta contents and attributes
    old._trainkit_meta = meta
    return old  # type: ignore[return-value]


def keep_part(param: Tensor, part: Callable[[Tensor], Tensor], view: Callable[[Tensor], Tensor] | None = None) -> None:
    """Cut ``param`` to ``part(param)`` in place (an axis's share of it: tensor parallelism's slice, expert
    parallelism's experts). On the meta device it remembers the whole it is a part of, so materialising gives it its
    part of the one-process value (or of the pretrained file's tensor): one whole tensor rebuilt or read at a time.
    ``view``: the same part as a view of the whole where it can be, so materialising copies none of it twice."""
    whole = param.data
    param.data = part(whole)
    if whole.is_meta:
        cut = view or part
        origin, before = getattr(param, "_trainkit_part", (whole, None))
        if before is None:
            origin._trainkit_name = getattr(param, "_trainkit_name", None)
            origin._trainkit_source = getattr(param, "_trainkit_source", None)
        param._trainkit_part = (origin, cut if before is None else _composed(before, cut))


def _composed(first: Callable[[Tensor], Tensor], then: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda t: then(first(t))


def name_meta_tensors(module: nn.Module) -> None:
    """Give every meta parameter and buffer of ``module`` its name there and the module's ``tensor_source``, before
    transforms move it (a pipeline's stage names its layers anew, and holds no source): a tensor read from a file is
    found by the name it has in the whole model."""
    source = getattr(module, "tensor_source", None)
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t.is_meta and not hasattr(t, "_trainkit_name"):
            t._trainkit_name, t._trainkit_source = name, source


def _stand_in(t: Tensor) -> Tensor:
    """The meta tensor the recorder knows ``t`` by: itself, its former self once replaced, or the whole it is a
    part of."""
    t = getattr(t, "_trainkit_meta", t)
    part = getattr(t, "_trainkit_part", None)
    return part[0] if part is not None else t


class WholeValue:
    """A meta tensor of ``root``'s one-process value, whole, in host memory (float32 for floating ones, as a rank
    keeps them): read from the root's ``tensor_source``, else replayed from the log; None where neither has it
    (``materialise_meta`` then falls back to its module's ``reset_parameters()``). For a strategy that keeps a
    range of each tensor (ZeRO-3/FSDP): it holds one whole tensor at a time beside its pieces."""

    def __init__(self, root: nn.Module, replayer: Replayer | None) -> None:
        self.replayer = replayer
        self.source: Source | None = getattr(root, "tensor_source", None)
        self.names = {t: n for n, t in (*root.named_parameters(), *root.named_buffers())} if self.source else {}

    def __call__(self, tensor: Tensor) -> Tensor | None:
        part = getattr(tensor, "_trainkit_part", None)
        if part is not None:  # an axis's part of a whole: the whole's value, cut as the axis cut it
            whole = self(part[0])
            return None if whole is None else part[1](whole)  # a view where it can be: no second copy
        dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
        name = getattr(tensor, "_trainkit_name", None) or self.names.get(tensor)
        read = (getattr(tensor, "_trainkit_source", None) or self.source) is not None and name is not None
        known = self.replayer is not None and self.replayer.knows(tensor)
        if known and not read:  # the draws it does not replay made before it is allocated
            self.replayer.prepare(tensor)
        out = torch.empty(tensor.shape, dtype=dtype)
        if _read(self.source, self.names, tensor, out, None):
            return out
        if known:
            self.replayer.fill(tensor, out)
            return out
        return None


def _read(source: Source | None, names: dict[Tensor, str], tensor: Tensor, out: Tensor, index: Any,
          meta: Tensor | None = None) -> bool:
    """Fill ``out`` with ``tensor``'s value (its part ``index``) from the module's ``tensor_source``, found by the
    name it had in the whole model (``name_meta_tensors``; ``meta``: its former self, which carries that name once
    replaced), else by its name in the root; False where the source has none."""
    tagged = meta if meta is not None else tensor
    name = getattr(tagged, "_trainkit_name", None) or names.get(tensor)
    source = getattr(tagged, "_trainkit_source", None) or source
    return source is not None and name is not None and source(name, out, index)
