"""Non-finite losses and gradient norms: noticed without a host synchronisation per step, and never checkpointed.

A NaN or an infinity in the loss spreads into the gradients and, through the optimizer, into every weight, so a run
that trains on is lost from that step on, and a checkpoint written after it would replace good ones with garbage.
``FiniteGuard`` notices it on any rank:

- Each micro-batch adds its loss, and each step its gradient norm where the step computes one (clipping, loss
  scaling), into a row of a small device buffer, one row per optimizer step. Adding is one kernel and no wait: a
  NaN or an infinity stays in the row's sum.
- The buffer is read where the loop waits anyway: at a logging step (``log_every_n_steps``, which is also the
  buffer's length), before a checkpoint is written, and when fit ends. The first non-finite row names the step
  and the metric.
- What one rank found the others learn at the next step boundary, with the preemption flags (``StepSignals``),
  and every rank stops at that boundary; before a checkpoint the ranks agree at once, since a save is collective.
- A checkpoint's own tensors are checked before they are written, whatever the loss said: an optimizer that made
  the weights non-finite (an infinite learning rate, a zero ``eps``) writes nothing either.

With ``on_nonfinite="skip"`` the step reads its global gradient norm instead (one host synchronisation per step,
as the fp16 loss scaler's overflow check does) and skips the optimizer step when it is not finite, every rank
alike; ``max_nonfinite_skips`` steps skipped in a row stop the run. Under fp16 loss scaling a step the scaler
skips (its gradients overflowed) is the scaler's to handle in either mode: its losses are forgotten, and only more
than ``max_nonfinite_skips`` such steps in a row stop the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from trainkit_strategies import Strategy
from trainkit_strategies.state.pieces import Piece

METRICS = ("loss", "gradient norm")


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or checkpointed tensor is NaN or infinite; raised alike on every rank."""


class FiniteGuard:
    """Collects each step's loss and gradient norm on the device and finds the first non-finite one.

    Args:
        strategy: the run's strategy (its device holds the buffer; its collectives agree on what was found).
        on_nonfinite: "stop" (the default: the run ends with ``NonFiniteError``) or "skip" (the optimizer step is
            skipped, and ``max_skips`` skips in a row stop the run).
        max_skips: under "skip", how many optimizer steps in a row may be skipped before the run stops.
        rows: steps between reads (the logging interval).
        hint: what to do next, for the error (the intact checkpoint to resume from).
    """

    def __init__(self, strategy: Strategy, on_nonfinite: str, max_skips: int, rows: int,
                 hint: Callable[[], str] = lambda: "") -> None:
        self.strategy, self.on_nonfinite, self.max_skips, self.hint = strategy, on_nonfinite, max_skips, hint
        self.skips = 0  # optimizer steps skipped in a row under "skip"
        self.found: tuple[int, str, float] | None = None  # (step, metric, value) first seen on this rank
        self._rows = max(1, rows)
        self._buffer: Tensor | None = None  # [rows, 2]: per step, the sum of its losses and its gradient norm
        self._losses: list[Tensor] = []  # views of the buffer's rows: indexing a tensor per step costs a dispatch
        self._norms: list[Tensor] = []
        self._filled = 0  # rows holding a step since the last read
        self._first = 0  # the global step of row 0
        self.last_step = 0  # the last optimizer step closed (the loop sets it when a fit starts or resumes)

    @property
    def records(self) -> bool:
        return self.on_nonfinite == "stop"

    def _allocate(self) -> None:
        self._buffer = torch.zeros(self._rows, 2, dtype=torch.float32, device=self.strategy.device)
        self._losses, self._norms = list(self._buffer[:, 0].unbind()), list(self._buffer[:, 1].unbind())

    def add_loss(self, loss: Tensor) -> None:
        """A micro-batch's loss, detached (on any rank, and any pipeline stage that has one)."""
        if self.records:
            if self._buffer is None:
                self._allocate()
            self._losses[self._filled].add_(loss if loss.dim() == 0 else loss.sum())

    def add_norm(self, norm: Tensor | None) -> None:
        """The step's global gradient norm, where the step computed one."""
        if self.records and norm is not None:
            if self._buffer is None:
                self._allocate()
            self._norms[self._filled].add_(norm.detach())

    def end_step(self, global_step: int) -> None:
        """Optimizer step ``global_step`` is closed: its row is complete."""
        self.last_step = global_step
        if self._buffer is None:
            return
        if self._filled == 0:
            self._first = global_step
        self._filled += 1
        if self._filled == self._rows:
            self.read()

    def read(self) -> tuple[int, str, float] | None:
        """What this rank has seen so far (a host synchronisation: call it where the loop waits anyway)."""
        if self._filled and self._buffer is not None and self.found is None:
            rows = self._buffer[: self._filled].cpu()
            bad = (~torch.isfinite(rows)).nonzero().tolist()
            if bad:
                row, column = bad[0]
                self.found = (self._first + row, METRICS[column], float(rows[row, column]))
            self._buffer[: self._filled].zero_()
        self._filled = 0
        return self.found

    def skip_step(self, norm: Tensor) -> bool:
        """Under "skip": whether the optimizer step being closed is skipped, its global gradient norm (the same on
        every rank) not being finite; more than ``max_skips`` in a row raise ``NonFiniteError``."""
        value = float(norm)
        if math.isfinite(value):
            self.skips = 0
            return False
        self._skipped(f"The gradient norm was {value}")
        return True

    def overflowed(self) -> None:
        """The loss scaler skipped the step being closed (fp16: its gradients overflowed, every rank alike). That is
        the scaler's to handle, so the step's losses are not held against the run; more than ``max_skips`` such
        steps in a row are: a scale halved that often is no longer calibrating."""
        if self._buffer is not None:
            self._losses[self._filled].zero_()
        self._skipped("The loss scaler found non-finite gradients")

    def _skipped(self, what: str) -> None:
        self.skips += 1
        if self.skips > self.max_skips:
            raise NonFiniteError(
                f"{what} at step {self.last_step + 1}, the {self.skips}th optimizer step in a row skipped for that "
                f"(max_nonfinite_skips={self.max_skips}). {self.hint()}")

    def agree(self, pieces: Sequence[Piece] = ()) -> None:
        """Collectively: raise ``NonFiniteError`` on every rank if any rank saw a non-finite loss or gradient norm,
        or holds a non-finite tensor among ``pieces`` (what it is about to checkpoint)."""
        found = self.read()
        bad_keys = nonfinite_keys(pieces)
        strategy = self.strategy
        everyone = strategy.all_gather_object((found, bad_keys)) if strategy.world_size > 1 else [(found, bad_keys)]
        seen = [(f, rank) for rank, (f, _) in enumerate(everyone) if f is not None]
        if seen:
            (step, metric, value), rank = min(seen, key=lambda s: s[0][0])
            where = f" on rank {rank}" if strategy.world_size > 1 else ""
            raise NonFiniteError(f"The {metric} was {value} at step {step}{where}. {self.hint()}")
        keys = sorted({key for _, ks in everyone for key in ks})
        if keys:
            raise NonFiniteError(f"The checkpoint about to be written holds non-finite values ({', '.join(keys[:5])}"
                                 f"{' ...' if len(keys) > 5 else ''}), so it was not written. {self.hint()}")


def nonfinite_keys(pieces: Sequence[Piece]) -> list[str]:
    """The keys of floating-point ``pieces`` holding a NaN or an infinity: one reduction per piece, one read per
    device."""
    by_device: dict[torch.device, list[Piece]] = {}
    for piece in pieces:
        if piece.data.is_floating_point() and piece.data.numel():
            by_device.setdefault(piece.data.device, []).append(piece)
    bad: list[str] = []
    for group in by_device.values():
        finite = torch.stack([torch.isfinite(p.data).all() for p in group]).tolist()
        bad += [p.key for p, ok in zip(group, finite, strict=True) if not ok]
    return sorted(set(bad))


def hint(last_checkpoint: str, on_nonfinite: str) -> str:
    """What to do after a non-finite step: fix the cause, then resume from the intact checkpoint."""
    other = "" if on_nonfinite == "skip" else (" To skip such steps instead of stopping, pass on_nonfinite='skip' "
                                               "(--trainer.on_nonfinite skip).")
    return (f"The run stopped there and saved nothing from it. {last_checkpoint} Lower the learning rate, clip "
            f"gradients (gradient_clip_val) or check the data for NaN.{other}")
