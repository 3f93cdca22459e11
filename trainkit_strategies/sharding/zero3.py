"""ZeRO-3 (Rajbhandari et al., 2020, §5.3), DeepSpeed-style: the sharding engine with units chosen by size.

Units are the modules that own parameters, consecutive ones bucketed up to ``bucket_mb`` per gather,
and parameters of at most ``persistence_threshold`` elements stay gathered for the whole run (as
DeepSpeed's ``stage3_param_persistence_threshold``): gathering many tiny tensors costs more in latency
than it saves in memory.
"""

from __future__ import annotations

from torch import Tensor, nn

from trainkit_strategies.sharding.engine import ShardedStrategy


class Zero3Strategy(ShardedStrategy):
    """DeepSpeed-style ZeRO-3: units are the modules that own parameters, consecutive ones bucketed up
    to ``bucket_mb`` per gather; parameters of at most ``persistence_threshold`` elements stay gathered.

    Args:
        bucket_mb: gather bucket size in MiB (consecutive parameter-owning modules share a gather).
        persistence_threshold: parameters with at most this many elements are never freed after gather.
        reshard_after_forward, prefetch, offload, ratio, broadcast_buffers: see ShardedStrategy.
    """

    name = "zero3"

    def __init__(self, bucket_mb: float = 25.0, persistence_threshold: int = 100_000,
                 reshard_after_forward: bool = True, prefetch: bool = True, offload: bool = False,
                 ratio: float = 1.0, broadcast_buffers: bool = True) -> None:
        super().__init__(reshard_after_forward, prefetch, offload, ratio, broadcast_buffers)
        if not bucket_mb > 0:
            raise ValueError(f"zero3 bucket_mb must be positive; got {bucket_mb}.")
        if persistence_threshold < 0:
            raise ValueError(f"zero3 persistence_threshold must be >= 0; got {persistence_threshold}.")
        self.bucket_mb, self.persistence_threshold = bucket_mb, persistence_threshold

    def is_persistent(self, param: Tensor) -> bool:
        return param.numel() <= self.persistence_threshold

    def unit_modules(self, module: nn.Module) -> list[list[nn.Module]]:
        limit = self.bucket_mb * 2**20
        buckets: list[list[nn.Module]] = []
        size = limit
        for mod in module.modules():
            own = [p for p in mod._parameters.values() if p is not None and not self.is_persistent(p)]
            if mod is module or not own:
                continue
            nbytes = sum(p.numel() * p.element_size() for p in own)
            if size + nbytes > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(mod)
            size += nbytes
        return buckets
