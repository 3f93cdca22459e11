"""FSDP: the sharding engine with units chosen by an auto-wrap policy (Zhao et al., 2023, §3)."""

from __future__ import annotations

from torch import nn

from trainkit_strategies.sharding.engine import ShardedStrategy
from trainkit_strategies.sharding.units import repeated_layers


class FSDPStrategy(ShardedStrategy):
    """Fully sharded data parallelism: one unit per wrapped module, gathered around its forward and
    backward, its gradients reduce-scattered as soon as its backward is done.

    Args:
        auto_wrap: module classes that become units (e.g. your transformer block). Default: the
            repeated layers of every ``nn.ModuleList`` / ``nn.Sequential`` (two or more children of
            one class).
        min_num_params: also wrap any module holding at least this many parameters not already in a
            wrapped descendant (size-based policy).
        sync_micro_steps: reduce-scatter on every accumulation micro-step (gradient shards accumulate).
            Off keeps whole gradients until the window's last backward: less communication, more memory.
        reshard_after_forward, prefetch, offload, ratio, broadcast_buffers: see ShardedStrategy.
    """

    name = "fsdp"

    def __init__(self, auto_wrap: list[type[nn.Module]] | None = None, min_num_params: int | None = None,
                 sync_micro_steps: bool = True, reshard_after_forward: bool = True, prefetch: bool = True,
                 offload: bool = False, ratio: float = 1.0, broadcast_buffers: bool = True) -> None:
        super().__init__(reshard_after_forward, prefetch, offload, ratio, broadcast_buffers)
        if min_num_params is not None and min_num_params < 1:
            raise ValueError(f"fsdp min_num_params must be >= 1; got {min_num_params}.")
        self.auto_wrap = tuple(auto_wrap or ())
        self.min_num_params = min_num_params
        self.sync_micro_steps = sync_micro_steps

    def unit_modules(self, module: nn.Module) -> list[list[nn.Module]]:
        chosen: list[nn.Module] = []
        if self.auto_wrap:
            chosen = [m for m in module.modules() if m is not module and isinstance(m, self.auto_wrap)]
        elif self.min_num_params is None:
            chosen = repeated_layers(module)
        if self.min_num_params is not None:
            chosen += self._by_size(module, set(chosen))
        order = {m: i for i, m in enumerate(module.modules())}
        return [[m] for m in sorted(set(chosen), key=order.__getitem__)]

    def _by_size(self, module: nn.Module, wrapped: set[nn.Module]) -> list[nn.Module]:
        """Bottom-up: wrap a module once the parameters it holds outside wrapped descendants reach the threshold."""
        out: list[nn.Module] = []

        def visit(mod: nn.Module) -> int:
            remaining = sum(p.numel() for p in mod.parameters(recurse=False))
            for child in mod.children():
                remaining += visit(child)
            if mod in wrapped:
                return 0
            callable_module = not isinstance(mod, nn.ModuleList | nn.ModuleDict)  # containers never run forward
            if mod is not module and callable_module and remaining >= self.min_num_params:
                out.append(mod)
                return 0
            return remaining

        visit(module)
        return out
