"""What a strategy says of itself to the planner (``trainkit estimate``, ``strategy="auto"``) and to telemetry (a part
of every ``Strategy``), so neither names a strategy: its communicators, whether it can train a module, the ranks
worth planning, its memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.capabilities import SelfReducing, optimizer_extras
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.planning.memory import MemoryReport

if TYPE_CHECKING:
    from trainkit_strategies.base import Strategy


class Planning:
    """``comms``/``comms_by_axis``, ``unfit_for``, ``planned``, ``describe``, ``activation_model``,
    ``memory_report``."""

    comm: Comm
    module: nn.Module | None
    optimizer: Optimizer | None
    manual_optimization: bool

    def comms(self) -> list[Comm]:
        """Every communicator this strategy moves data through (their stats together are its traffic)."""
        return [self.comm]

    def comms_by_axis(self) -> dict[str, list[Comm]]:
        """``comms()`` by the axis of the layout they run along ("dp" for a one-axis data-parallel strategy; "tp",
        "pp", "dp_shard", "dp_replicate" on a mesh): what a plan reports as bytes per step per axis."""
        return {"dp": self.comms()}

    def unfit_for(self, module: nn.Module, optimizer: Optimizer | None) -> str | None:
        """Why this strategy cannot train ``module`` with ``optimizer`` (None: it can)."""
        if isinstance(optimizer, SelfReducing) and not self.accepts_self_reducing:
            return f"{type(optimizer).__name__} does not run under {self.name}"
        if not getattr(module, "automatic_optimization", True) and not self.manual_optimization:
            return f"{self.name} does not run manual optimization"
        return None

    def planned(self, module: nn.Module, world_size: int) -> tuple[Strategy, list[int]]:
        """This strategy as it would train ``module`` on ``world_size`` ranks (options left to it decided), and the
        ranks whose plans differ enough to compare for the heaviest (not rank 0: uneven shards pad the last ranks; a
        pipeline's stages)."""
        return self, [1 if world_size > 1 else 0]

    def describe(self) -> str:
        """After setup: what a plan's note says of this rank's share (a pipeline's stages, a mesh's layout)."""
        return ""

    def activation_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``model`` (a meta copy of the user's module) rewritten as this rank computes it, for tracing the
        activations a rank saves (tensor-parallel layers compute on slices); the model itself by default."""
        return model

    def memory_report(self) -> MemoryReport:
        assert self.module is not None
        opt_state = [] if self.optimizer is None else [
            t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, Tensor)
        ]
        return MemoryReport.of({
            "params": list(self.module.parameters()),
            "grads": self.gradients(),
            "master": [],
            "optimizer": opt_state + optimizer_extras(self),  # with compression's error feedback
            "buffers": list(self.module.buffers()),
        })
