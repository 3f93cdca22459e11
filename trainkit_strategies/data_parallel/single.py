"""One process, one device: the reference every other strategy is held to."""

from __future__ import annotations

from trainkit_strategies.base import Strategy
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.environment import Environment
from trainkit_strategies.init.materialise import RecordsInit


class SingleStrategy(RecordsInit, Strategy):
    """Train on one device in one process. The replicated defaults of ``Strategy`` are the algorithm; the model is
    built on meta and materialised straight on the device (``RecordsInit``)."""

    name = "single"
    accepts_self_reducing = True

    def setup_environment(self, env: Environment, comm: Comm | None = None) -> None:
        if env.world_size != 1:
            raise ValueError(
                f"Strategy 'single' runs one process, but this run has world_size={env.world_size}. "
                "Use --trainer.strategy ddp (or another distributed strategy) for several processes."
            )
        super().setup_environment(env, comm)
