"""PowerSGD (Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization"): rank-r gradient compression with error feedback, applied to ddp's gradient buckets.

Each gradient matrix M (a parameter with two or more dimensions, viewed as ``shape[0] x rest``) is sent
as two thin factors instead of itself (Algorithm 1, one step of subspace iteration, warm-started from the
previous step's Q, §3):

    M  = local gradient + error                 (error feedback, Algorithm 2)
    P  = M Q                                    computed as soon as backward fills the bucket
    all-reduce P                                every bucket's in one collective, at the step boundary
    P^ = orthogonalise(P)                       (Gram-Schmidt on the r columns)
    Q  = M^T P^              all-reduce Q       every bucket's in one collective (kept as Q^T = P^T M: row-major)
    error = M - P^ Q_local^T                    what this rank's gradient lost
    M^ = P^ Q^T                                 the sum over ranks, of rank r

A bucket's vectors (biases, norms) and matrices too small to gain (r(n+m) >= nm) travel uncompressed in
the same all-reduce as P. Bytes per matrix go from nm to r(n+m), in fp32. The factors are small (a few
hundred kB for tens of MB of gradients), so a step's cost is its collectives' latency and the ranks meeting
at each, not their bytes: two collectives a step, whatever the number of buckets (with one per bucket and
factor, a step across a 1 Gb/s link took 78 ms with the default 25 MiB buckets and 92 ms with 4 MiB ones on
the reference MLP; batched, 83.5 and 82.9 ms in another run). For ``warmup_steps`` optimizer
steps the buckets are all-reduced whole (the paper and torch's hook start compression after the
gradients' early, high-rank phase).

The error buffers and the warm-start Q differ between ranks or runs, so they are rank-local checkpoint
state: a resume at the same world size continues exactly; at another one they start afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainkit_strategies.communication.comm import Comm


@dataclass
class _Matrix:
    """One compressed parameter: elements ``[start, start + rows * cols)`` of its bucket."""

    start: int
    rows: int
    cols: int
    qt: Tensor  # (r, cols): Q transposed (row-major products are several times faster); warm start, same everywhere
    error: Tensor | None = None  # (rows, cols) fp32, this rank's


@dataclass
class _Plan:
    """How one bucket travels: its matrices, the ranges sent whole, and the two wire buffers."""

    matrices: list[_Matrix]
    rest: list[tuple[int, int]]
    p_wire: Tensor  # all P (rows x r each), then the uncompressed ranges: a view of the step's one P buffer
    q_wire: Tensor  # all Q^T (r x cols each): a view of the step's one Q buffer


def orthogonalise(p: Tensor, eps: float = 1e-30) -> None:
    """Gram-Schmidt on the columns of ``p`` in place (a zero column stays zero rather than dividing by 0)."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(torch.linalg.vector_norm(col).clamp_min(eps))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))


class PowerSGD:
    """Rank-``rank`` compression of ddp's gradient buckets after ``warmup_steps`` uncompressed steps.

    ``error_feedback=False`` drops the errors (the compression bias then accumulates: for ablations).
    """

    def __init__(self, rank: int = 1, warmup_steps: int = 100, error_feedback: bool = True, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1; got {rank}.")
        if warmup_steps < 0:
            raise ValueError(f"powersgd warmup_steps must be >= 0; got {warmup_steps}.")
        self.rank, self.warmup_steps, self.error_feedback, self.seed = rank, warmup_steps, error_feedback, seed
        self.steps = 0
        self._plans: list[_Plan] = []

    @property
    def active(self) -> bool:
        return self.steps >= self.warmup_steps

    def build(self, buckets: list[list[tuple[int, torch.Size]]], device: torch.device) -> None:
        """``buckets``: per bucket, (offset, shape) of each parameter in it."""
        generator = torch.Generator().manual_seed(self.seed)
        self._plans = []
        sizes = []
        for layout in buckets:
            matrices, rest = [], []
            for offset, shape in layout:
                numel = shape.numel()
                rows = shape[0] if len(shape) >= 2 else numel
                cols = numel // rows if len(shape) >= 2 else 1
                if len(shape) >= 2 and self.rank * (rows + cols) < numel:
                    qt = torch.randn(self.rank, cols, generator=generator).to(device)
                    matrices.append(_Matrix(offset, rows, cols, qt))
                else:
                    rest.append((offset, offset + numel))
            p_numel = sum(m.rows * self.rank for m in matrices) + sum(b - a for a, b in rest)
            q_numel = sum(m.cols * self.rank for m in matrices)
            sizes.append((p_numel, q_numel))
            self._plans.append(_Plan(matrices, rest, torch.empty(0), torch.empty(0)))
        self._p = torch.empty(sum(p for p, _ in sizes), device=device)
        self._q = torch.empty(sum(q for _, q in sizes), device=device)
        p_offset = q_offset = 0
        for plan, (p_numel, q_numel) in zip(self._plans, sizes, strict=True):
            plan.p_wire = self._p[p_offset : p_offset + p_numel]
            plan.q_wire = self._q[q_offset : q_offset + q_numel]
            p_offset, q_offset = p_offset + p_numel, q_offset + q_numel

    def wire_bytes(self, index: int) -> int:
        """Bytes one compressed step all-reduces for bucket ``index``."""
        plan = self._plans[index]
        return (plan.p_wire.numel() + plan.q_wire.numel()) * 4

    # -- one step: P per bucket (during backward), then the exchange (at the boundary) ----------------------
    def launch(self, index: int, buffer: Tensor) -> None:
        """Bucket ``index`` (``buffer``) is complete: add its error, form P = M Q, stage what travels whole."""
        plan = self._plans[index]
        offset = 0
        for m in plan.matrices:
            grad = self._view(buffer, m)
            if self.error_feedback:
                if m.error is None:
                    m.error = torch.zeros(m.rows, m.cols, device=buffer.device)
                grad.add_(m.error)
            p = plan.p_wire[offset : offset + m.rows * self.rank].view(m.rows, self.rank)
            torch.mm(grad.float(), m.qt.T, out=p)
            offset += m.rows * self.rank
        for a, b in plan.rest:
            plan.p_wire[offset : offset + b - a].copy_(buffer[a:b])
            offset += b - a

    def exchange(self, buffers: list[Tensor], comm: Comm) -> None:
        """Every bucket launched: all-reduce every P at once; orthogonalise, form each Q and error; all-reduce every
        Q at once; write P^ Q^T (the sum over ranks) into each bucket and keep Q as the next warm start."""
        comm.all_reduce(self._p)
        for plan, buffer in zip(self._plans, buffers, strict=True):
            self._form_q(plan, buffer)
        if self._q.numel():
            comm.all_reduce(self._q)
        for plan, buffer in zip(self._plans, buffers, strict=True):
            self._decompress(plan, buffer)

    def _form_q(self, plan: _Plan, buffer: Tensor) -> None:
        p_offset = q_offset = 0
        for m in plan.matrices:
            grad = self._view(buffer, m).float()
            p = plan.p_wire[p_offset : p_offset + m.rows * self.rank].view(m.rows, self.rank)
            orthogonalise(p)
            qt = plan.q_wire[q_offset : q_offset + m.cols * self.rank].view(self.rank, m.cols)
            torch.mm(p.T, grad, out=qt)
            if self.error_feedback:
                assert m.error is not None
                torch.addmm(grad, p, qt, alpha=-1, out=m.error)
            p_offset += m.rows * self.rank
            q_offset += m.cols * self.rank
        for a, b in plan.rest:
            buffer[a:b].copy_(plan.p_wire[p_offset : p_offset + b - a])
            p_offset += b - a

    def _decompress(self, plan: _Plan, buffer: Tensor) -> None:
        p_offset = q_offset = 0
        for m in plan.matrices:
            p = plan.p_wire[p_offset : p_offset + m.rows * self.rank].view(m.rows, self.rank)
            m.qt.copy_(plan.q_wire[q_offset : q_offset + m.cols * self.rank].view(self.rank, m.cols))
            view = self._view(buffer, m)
            if view.dtype == torch.float32:
                torch.mm(p, m.qt, out=view)
            else:
                view.copy_(p @ m.qt)
            p_offset += m.rows * self.rank
            q_offset += m.cols * self.rank

    @staticmethod
    def _view(buffer: Tensor, m: _Matrix) -> Tensor:
        return buffer[m.start : m.start + m.rows * m.cols].view(m.rows, m.cols)

    # -- rank-local state ------------------------------------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        out = {"steps": torch.tensor([self.steps], dtype=torch.int64)}
        for i, plan in enumerate(self._plans):
            for j, m in enumerate(plan.matrices):
                out[f"bucket{i}/q{j}"] = m.qt
                if m.error is not None:
                    out[f"bucket{i}/error{j}"] = m.error
        return out

    def load(self, state: dict[str, Tensor]) -> bool:
        """Restore ``state()``; False (and nothing changed) when it was saved for another bucket layout."""
        shapes: dict[str, tuple[int, ...]] = {"steps": (1,)}
        for i, plan in enumerate(self._plans):
            for j, m in enumerate(plan.matrices):
                shapes[f"bucket{i}/q{j}"] = (self.rank, m.cols)
                shapes[f"bucket{i}/error{j}"] = (m.rows, m.cols)
        required = {k for k in shapes if "/error" not in k}
        if not required <= state.keys() or any(tuple(v.shape) != shapes.get(k) for k, v in state.items()):
            return False
        self.steps = int(state["steps"][0])
        for i, plan in enumerate(self._plans):
            for j, m in enumerate(plan.matrices):
                m.qt.copy_(state[f"bucket{i}/q{j}"])
                error = state.get(f"bucket{i}/error{j}")
                m.error = None if error is None else error.to(m.qt.device, torch.float32).clone()
        return True
