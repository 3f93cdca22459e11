"""Precision policies and dynamic loss scaling.

A policy says three things a strategy needs: the dtype its parameters are held in, the dtype the
forward runs in (through autocast), and whether the loss is scaled. Sharded strategies (ZeRO) read
``compute_dtype`` to keep low-precision working parameters beside fp32 master shards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from lightning_utilities.core.apply_func import apply_to_collection

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16}  # what options such as ``reduce_dtype`` accept


@dataclass(frozen=True)
class Precision:
    """A precision policy.

    Attributes:
        name: one of ``PRECISIONS``.
        param_dtype: dtype the model's parameters (and so the optimizer state) are stored in.
        compute_dtype: dtype the forward pass runs in under autocast; ``None`` means no autocast.
        loss_scaling: scale the loss dynamically so fp16 gradients do not underflow.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype | None
    loss_scaling: bool

    @classmethod
    def from_name(cls, name: str | int) -> Precision:
        name = str(name)
        aliases = {"32-true": "32", "fp32": "32", "bf16": "bf16-mixed", "16": "16-mixed"}
        name = aliases.get(name, name)
        if name == "32":
            return cls(name, torch.float32, None, False)
        if name == "bf16-mixed":
            return cls(name, torch.float32, torch.bfloat16, False)
        if name == "16-mixed":
            return cls(name, torch.float32, torch.float16, True)
        if name == "bf16-true":
            return cls(name, torch.bfloat16, None, False)
        raise ValueError(f"Unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}.")

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None

    @property
    def working_dtype(self) -> torch.dtype:
        """The dtype sharded strategies keep working parameters (and gradients) in."""
        return self.compute_dtype or self.param_dtype

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

