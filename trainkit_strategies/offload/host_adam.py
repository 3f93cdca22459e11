"""The host half of an offloaded step: Adam/AdamW over runs of master pieces in host memory, one pass per run.

Under offload the gradients reach the host in the compute dtype (bf16, say), the fp32 master weights and Adam moments
live in host memory, and the device wants its parameters back in the compute dtype. Per parameter that is memory
traffic, about 28 bytes, and nothing else: the step reads the gradient, master and moments and writes master,
moments and the compute-dtype copy in one pass (``csrc/host_adam.c``, built on first use by ``native.py``), on every
core, in one call per run of pieces that lie end to end in host memory, with the GIL released. The compute-dtype copy
may be written over the gradient it came from, so no buffer of its own is needed to send it back.

The moments are flat too: per flat of master pieces, one ``exp_avg`` and one ``exp_avg_sq`` (and ``max_exp_avg_sq``
under amsgrad), whose views are each piece's state in ``optimizer.state``, where checkpoints read and write them, and
the pieces of a flat share one ``step`` tensor. State that arrives from elsewhere (``optimizer.load_state_dict``)
is copied into the flats at the next step.

Where no C compiler works, each run steps with torch's fused kernel in slices (the gradient converted into a
scratch slice, the update, the compute-dtype copy: three passes over a slice instead of one).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim import Optimizer

from trainkit_strategies.offload import native

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KINDS = "float32, bfloat16 or float16"
_DECOUPLED, _AMSGRAD, _MAXIMIZE = 1, 2, 4
SLICE = 1 << 22  # elements per call of torch's kernels on the fallback path (a 16 MiB fp32 scratch)


def supported(optimizer: Optimizer, master_dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``optimizer`` is an Adam or AdamW the host step runs (the offload path) on fp32 master weights."""
    return master_dtype == torch.float32 and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and not any(
        g.get("differentiable", False) for g in optimizer.param_groups)


def _kernel() -> ctypes._CFuncPtr | None:
    library = native.load("host_adam")
    if library is None:
        return None
    fn = library.tk_adam_step
    if fn.argtypes is None:
        ptr = ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int64, ptr, ctypes.c_int,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def uses_kernel() -> bool:
    """Whether host steps run the compiled kernel (else torch's kernels; ``native.why_not("host_adam")`` says why)."""
    return _kernel() is not None


def follows(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` starts where ``a`` ends in memory (same dtype, both contiguous): they can step as one run."""
    return (a.dtype == b.dtype and a.device == b.device and a.is_contiguous() and b.is_contiguous()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() and not a.is_meta)


def _check_run(pieces: list[Tensor], grads: list[Tensor], outs: list[Tensor] | None) -> int:
    """The length of a run, once its buffers are known to be what the kernel reads. It takes a raw pointer and one
    length per buffer, so a short, strided, foreign-dtype or off-host buffer would be read past its end, misread
    (every other element as if adjacent, integers as floats: silently wrong weights) or dereferenced where the host
    cannot reach (a crash): each is refused here, by name, before anything is written."""
    n = sum(p.numel() for p in pieces)
    for arg, tensors in (("pieces", pieces), ("grads", grads), ("outs", outs or [])):
        if arg == "grads" and not tensors:
            raise ValueError("HostAdam.step: grads is empty.")
        for i, t in enumerate(tensors):
            if t.device.type != "cpu":
                raise ValueError(f"HostAdam.step: {arg}[{i}] (shape {tuple(t.shape)}) is in {t.device} memory; "
                                 "the host step reads and writes host (CPU) memory only.")
            if arg != "pieces" and t.dtype not in _CODES:
                raise TypeError(f"HostAdam.step: {arg}[{i}] (shape {tuple(t.shape)}) is {t.dtype}; {arg} must be "
                                f"{_KINDS}.")
            if not t.is_contiguous():
                raise ValueError(f"HostAdam.step: {arg}[{i}] of shape {tuple(t.shape)} and stride {t.stride()} is "
                                 f"not contiguous; the kernel reads {arg} as one dense run.")
            if i and not follows(tensors[i - 1], t):
                raise ValueError(f"HostAdam.step: {arg}[{i}] does not start where {arg}[{i - 1}] ends; a run's "
                                 f"{arg} lie end to end in one buffer.")
        held = sum(t.numel() for t in tensors)
        if tensors and held != n:
            raise ValueError(f"HostAdam.step: {arg} hold {held} elements; pieces hold {n} (one for each).")
    return n


@dataclass(eq=False)
class _Flat:
    """One flat of master pieces and its moments (allocated at the first step, as torch allocates its state)."""

    master: Tensor
    group: int
    pieces: list[tuple[Tensor, int]]  # (piece, offset in ``master``)
    moments: dict[str, Tensor] = field(default_factory=dict)  # "exp_avg", "exp_avg_sq", "max_exp_avg_sq"
    step: Tensor | None = None
    count: float = 0.0  # the step being taken


class HostAdam:
    """Adam/AdamW of ``optimizer`` for master pieces laid out in host ``flats``: ``(flat, param group, [(piece,
    offset)])``. ``begin`` starts an optimizer step; ``step`` then updates any run of adjacent pieces."""

    def __init__(self, optimizer: Optimizer, flats: list[tuple[Tensor, int, list[tuple[Tensor, int]]]]) -> None:
        if not supported(optimizer):
            raise TypeError(f"HostAdam needs torch.optim.Adam or AdamW; got {type(optimizer).__name__}.")
        self.optimizer = optimizer
        self.flats = [_Flat(master, group, pieces) for master, group, pieces in flats]
        self._flat_of = {id(piece): flat for flat in self.flats for piece, _ in flat.pieces}
        self.mult = 1.0
        self.threads = 1  # cores each run uses (read at each run: a step during backward widens once it is over)
        self._hyper: dict[int, tuple[ctypes.Array, int]] = {}  # per flat, the kernel's arguments for this step
        self._scratch: Tensor | None = None

    def flat_of(self, piece: Tensor) -> _Flat:
        """The flat ``piece`` lies in (pieces of different flats never share a run)."""
        return self._flat_of[id(piece)]

    def begin(self, mult: float, threads: int) -> None:
        """Start an optimizer step: gradients will be multiplied by ``mult``; each call uses ``threads`` cores."""
        self.mult, self.threads = float(mult), max(1, threads)
        self._hyper.clear()
        for flat in self.flats:
            group = self.optimizer.param_groups[flat.group]
            self.adopt(flat)
            assert flat.step is not None
            flat.step += 1
            flat.count = 1.0 if flat.master.is_meta else float(flat.step)
            beta1, beta2 = (float(b) for b in group["betas"])
            flags = (_DECOUPLED if _decoupled(self.optimizer, group) else 0) | \
                (_AMSGRAD if group.get("amsgrad", False) else 0) | (_MAXIMIZE if group.get("maximize", False) else 0)
            hyper = (ctypes.c_double * 7)(float(group["lr"]), beta1, beta2, float(group["eps"]),
                                          float(group["weight_decay"]), flat.count, self.mult)
            self._hyper[id(flat)] = (hyper, flags)

    def step(self, pieces: list[Tensor], grads: list[Tensor], outs: list[Tensor] | None = None) -> None:
        """Update ``pieces`` (adjacent in one flat) from ``grads`` (adjacent, float32, bfloat16 or float16),
        writing the updated pieces into ``outs`` (adjacent, the same dtypes; may be ``grads`` themselves) if given.
        Raises ``ValueError`` or ``TypeError`` naming the argument that is not so (see ``_check_run``)."""
        if not pieces:
            raise ValueError("HostAdam.step: pieces is empty.")
        flat = self._flat_of.get(id(pieces[0]))
        for i, piece in enumerate(pieces):
            if flat is None or self._flat_of.get(id(piece)) is not flat:
                raise ValueError(f"HostAdam.step: pieces[{i}] (shape {tuple(piece.shape)}) is not a master piece "
                                 f"{'of the flat pieces[0] lies in' if i else 'HostAdam was given'}.")
        if flat.master.is_meta:  # planned on the meta device (trainkit estimate): the state exists, no values
            return
        n = _check_run(pieces, grads, outs)
        lo = (pieces[0].data_ptr() - flat.master.data_ptr()) // flat.master.element_size()
        grad, out = grads[0], outs[0] if outs else None
        hyper, flags = self._hyper[id(flat)]
        kernel = _kernel()
        with torch.profiler.record_function("trainkit::host_adam"):
            if kernel is not None:
                at = lambda name: (flat.moments[name].data_ptr() + lo * flat.master.element_size()
                                   if name in flat.moments else None)
                code = kernel(pieces[0].data_ptr(), grad.data_ptr(), _CODES[grad.dtype], at("exp_avg"),
                              at("exp_avg_sq"), at("max_exp_avg_sq"), out.data_ptr() if out is not None else None,
                              _CODES[out.dtype] if out is not None else -1, n, hyper, flags, self.threads)
                if code:
                    raise RuntimeError(f"host_adam rejected gradient {grad.dtype} / output {out and out.dtype}.")
            else:
                whole = lambda t: t.as_strided((n,), (1,), t.storage_offset())
                self._torch_step(flat, flat.master[lo : lo + n], whole(grad),
                                 {k: v[lo : lo + n] for k, v in flat.moments.items()},
                                 whole(out) if out is not None else None)

    def _torch_step(self, flat: _Flat, master: Tensor, grad: Tensor, moments: dict[str, Tensor],
                    out: Tensor | None) -> None:
        """The same step with torch's fused kernel, slice by slice (no compiler here)."""
        group = self.optimizer.param_groups[flat.group]
        op = torch._fused_adamw_ if _decoupled(self.optimizer, group) else torch._fused_adam_
        beta1, beta2 = (float(b) for b in group["betas"])
        unscale = None if self.mult == 1.0 else torch.tensor([1.0 / self.mult], dtype=torch.float32, device="cpu")
        step = torch.tensor(flat.count, dtype=torch.float32, device="cpu")
        options = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=float(group["weight_decay"]),
                       eps=float(group["eps"]), amsgrad=bool(group.get("amsgrad", False)),
                       maximize=bool(group.get("maximize", False)), grad_scale=unscale)
        if self._scratch is None:
            self._scratch = torch.empty(SLICE, dtype=torch.float32, device="cpu")
        maxes = moments.get("max_exp_avg_sq")
        for lo in range(0, master.numel(), SLICE):
            hi = min(master.numel(), lo + SLICE)
            g = grad[lo:hi] if grad.dtype == torch.float32 else self._scratch[: hi - lo].copy_(grad[lo:hi])
            op([master[lo:hi]], [g], [moments["exp_avg"][lo:hi]], [moments["exp_avg_sq"][lo:hi]],
               [maxes[lo:hi]] if maxes is not None else [], [step], **options)
            if out is not None:
                out[lo:hi].copy_(master[lo:hi])

    def adopt(self, flat: _Flat) -> None:
        """Make every piece's state views of the flat's moments and one shared step, keeping values found there
        (a fresh piece starts from zeros, as torch's Adam does)."""
        group = self.optimizer.param_groups[flat.group]
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad", False) else [])
        zeroed = {name for name in names if name not in flat.moments}  # allocated now, as zeros
        for name in zeroed:
            flat.moments[name] = torch.zeros_like(flat.master)
        state = self.optimizer.state
        if flat.step is None:
            flat.step = torch.zeros((), dtype=torch.float32, device=flat.master.device)
        counts = [float(state[p]["step"]) for p, _ in flat.pieces if state.get(p) and state[p].get("step") is not None
                  and state[p]["step"] is not flat.step]
        if counts:
            flat.step.fill_(max(counts))
        size = flat.master.element_size()
        for piece, offset in flat.pieces:
            mine = state.get(piece, {})
            if mine.get("step") is flat.step and all(
                    name in mine and mine[name].data_ptr() == flat.moments[name].data_ptr() + offset * size
                    for name in names):
                continue  # the steady state: nothing to look at but pointers
            for name in names:
                view = flat.moments[name][offset : offset + piece.numel()].view_as(piece)
                held = mine.get(name)
                if held is not None and held.data_ptr() == view.data_ptr():
                    continue
                if held is not None and held.numel() == view.numel():
                    view.copy_(held)
                elif name not in zeroed and not flat.master.is_meta:
                    view.zero_()  # a piece without state starts afresh, as under torch's Adam
                mine[name] = view
            mine["step"] = flat.step
            state[piece] = mine


def _decoupled(optimizer: Optimizer, group: dict) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
