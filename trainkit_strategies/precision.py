"""Precision policies and dynamic loss scaling.

A policy says what a strategy and the optimizer step need: the dtype parameters are held in, the dtype the
forward runs in (through autocast), and, under "16-mixed", the loss scaler it owns (as Lightning's precision plugin
owns its GradScaler): the step asks the policy for the loss scale and whether a step is skipped, and never for a
scaler. Sharded strategies (ZeRO) read ``compute_dtype`` to keep low-precision working parameters beside fp32
master shards. The policy also says what gradients are summed across ranks in (``reduce_dtype``, FSDP2's
``MixedPrecisionPolicy.reduce_dtype``): set once, for every strategy, instead of an option of each; a strategy that
cannot reduce in it refuses it at setup. ``dtype_named`` checks every dtype option in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from lightning_utilities.core.apply_func import apply_to_collection

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16}  # what dtype options (``reduce_dtype``) accept


def dtype_named(name: str | None, option: str) -> torch.dtype | None:
    """The dtype ``name`` means (None stays None: the policy's default), or a ValueError naming ``option``."""
    if name is None:
        return None
    if name not in DTYPE_NAMES:
        raise ValueError(f"{option} must be one of {sorted(DTYPE_NAMES)}; got {name!r}.")
    return DTYPE_NAMES[name]


@dataclass(frozen=True)
class Precision:
    """A precision policy.

    Attributes:
        name: one of ``PRECISIONS``.
        param_dtype: dtype the model's parameters (and so the optimizer state) are stored in.
        compute_dtype: dtype the forward pass runs in under autocast; ``None`` means no autocast.
        loss_scaling: scale the loss dynamically so fp16 gradients do not underflow.
        scaler: the loss scaler of a policy with ``loss_scaling`` (its state is the run's: checkpointed).
        reduce_dtype: dtype gradients are summed across ranks and accumulated in; ``None``: the gradients' own
            (the working parameters'). fp32 under bf16-mixed sums bf16 gradients exactly, at twice the bytes.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype | None
    loss_scaling: bool
    scaler: DynamicLossScaler | None = field(default=None, compare=False, repr=False)
    reduce_dtype: torch.dtype | None = None

    @classmethod
    def from_name(cls, name: str | int, scaler: DynamicLossScaler | None = None,
                  reduce_dtype: str | None = None) -> Precision:
        """The policy ``name`` names; "16-mixed" with ``scaler`` (default: a new ``DynamicLossScaler``); gradients
        reduced in ``reduce_dtype`` ("fp32", "bf16", "fp16" or their long names; None: their own dtype)."""
        name = str(name)
        aliases = {"32-true": "32", "fp32": "32", "bf16": "bf16-mixed", "16": "16-mixed"}
        name = aliases.get(name, name)
        reduced = dtype_named(reduce_dtype, "reduce_dtype")
        if scaler is not None and name != "16-mixed":
            raise ValueError(f"Precision {name!r} scales no loss; a loss scaler goes with '16-mixed' only.")
        if name == "32":
            return cls(name, torch.float32, None, False, reduce_dtype=reduced)
        if name == "bf16-mixed":
            return cls(name, torch.float32, torch.bfloat16, False, reduce_dtype=reduced)
        if name == "16-mixed":
            return cls(name, torch.float32, torch.float16, True, scaler or DynamicLossScaler(), reduced)
        if name == "bf16-true":
            return cls(name, torch.bfloat16, None, False, reduce_dtype=reduced)
        raise ValueError(f"Unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}.")

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without loss scaling); gradients are divided by it."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def skips_step(self, global_norm: Callable[[], torch.Tensor]) -> tuple[bool, torch.Tensor | None]:
        """Whether this step is skipped, and the norm it was decided on: under loss scaling the step is skipped when
        the global gradient norm (the same on every rank) is not finite, and the scale backs off or grows; other
        policies skip nothing and compute no norm."""
        if self.scaler is None:
            return False, None
        norm = global_norm()
        skip = not bool(torch.isfinite(norm))
        self.scaler.update(found_inf=skip)
        return skip, norm

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None

    @property
    def working_dtype(self) -> torch.dtype:
        """The dtype sharded strategies keep working parameters (and gradients) in."""
        return self.compute_dtype or self.param_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype a strategy that keeps working parameters reduces and accumulates gradients in: ``reduce_dtype``,
        by default the working parameters' (the dtype autograd leaves their gradients in)."""
        return self.reduce_dtype or self.working_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of master weights and optimizer state: fp32 under the mixed policies."""
        return torch.float32 if self.mixed else self.param_dtype

    @property
    def converts_input(self) -> bool:
        """A "true" low-precision policy: floating-point inputs are cast to the parameters' dtype."""
        return self.compute_dtype is None and self.param_dtype != torch.float32

    def convert_input(self, batch: object) -> object:
        """Cast the batch's floating-point tensors to ``param_dtype`` under "bf16-true" (integer tensors,
        token ids say, are left alone); the batch itself under every other policy."""
        if not self.converts_input:
            return batch
        dtype = self.param_dtype
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Autocast for mixed policies; a no-op context otherwise, and on a device autocast does not run on (the
        meta device, where ``trainkit estimate`` and the device-rule tests set strategies up: no values exist there
        to round, and its kernels take mixed dtypes)."""
        if self.compute_dtype is None or not torch.amp.is_autocast_available(device.type):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al., 2018, §3.2), with torch GradScaler's defaults.

    The scale multiplies the loss before backward. After a step whose (global) gradients held an
    inf or nan the step is skipped and the scale is multiplied by ``backoff_factor``; after
    ``growth_interval`` clean steps in a row it is multiplied by ``growth_factor``. The decision is
    taken by the caller on a globally reduced norm, so every rank skips together.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                "DynamicLossScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}."
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

