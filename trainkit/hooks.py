"""The hook set TrainModule exposes. Callbacks (trainkit.callbacks.Callback) get the same names with
``(trainer, module, ...)`` prepended. Hooks that are not overridden cost nothing: the trainer builds its
dispatch lists from the methods a subclass actually defines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

HOOK_NAMES = (
    "setup", "teardown",
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
    "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_end",
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
    "on_train_step_end", "on_save_checkpoint", "on_load_checkpoint",
)


@dataclass(frozen=True)
class StepTiming:
    """What one optimizer step took, for ``on_train_step_end``.

    Attributes:
        forward_backward_s: seconds in the forward and backward passes of the step's micro-batches (all of its
            accumulation window; a pipeline's whole schedule).
        optimizer_s: seconds in the optimizer step: gradient reduction, clipping, the step itself, zeroing.
        skipped: an fp16 overflow skipped the step (the parameters did not change; ``global_step`` still counts it).
    """

    forward_backward_s: float
    optimizer_s: float
    skipped: bool = False


class ModelHooks:
    """No-op hooks; override the ones you need."""

    def setup(self, stage: str) -> None:
        """Called on every rank before the model is placed: ``stage`` is fit, validate, test or predict."""

    def teardown(self, stage: str) -> None: ...

    def on_fit_start(self) -> None: ...

    def on_fit_end(self) -> None: ...

    def on_train_start(self) -> None: ...

    def on_train_end(self) -> None: ...

    def on_train_epoch_start(self) -> None: ...

    def on_train_epoch_end(self) -> None: ...

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_validation_start(self) -> None: ...

    def on_validation_end(self) -> None: ...

    def on_validation_epoch_start(self) -> None: ...

    def on_validation_epoch_end(self) -> None: ...

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_test_start(self) -> None: ...

    def on_test_end(self) -> None: ...

    def on_test_epoch_start(self) -> None: ...

    def on_test_epoch_end(self) -> None: ...

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_predict_start(self) -> None: ...

    def on_predict_end(self) -> None: ...

    def on_predict_epoch_start(self) -> None: ...

    def on_predict_epoch_end(self) -> None: ...

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_before_backward(self, loss: Tensor) -> None: ...

    def on_after_backward(self) -> None:
        """Gradients of this micro-batch are accumulated (not yet reduced across ranks or normalised)."""

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Gradients are reduced, normalised and unscaled; clipping has not happened yet."""

    def on_before_zero_grad(self, optimizer: Optimizer) -> None: ...

    def on_train_step_end(self, timing: StepTiming) -> None:
        """After each optimizer step (once per accumulation window), once ``global_step`` counts it and after the
        ``on_train_batch_end`` of its last micro-batch: where "a step ended" is decided, with what it took."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add JSON-serialisable entries to ``checkpoint`` (saved in meta.json)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
