"""The ``cp`` axis of ``strategy="parallel"``: each rank of a context-parallel group holds two of ``2 x cp`` chunks
of every sequence (``local_batch``), and attention runs across the group (``ring.py``, ``ulysses.py``).

The transform installs the group on every module of the model (``axis.install``), where ``attention`` and
``positions`` find it from the layer calling them, and adopts Hugging Face attention (``huggingface.py``). Gradients
need nothing of it: the sharding engine's group takes in the context-parallel ranks (torchtitan's ``dp_shard x
cp``), and attention's traffic rides on that engine's communicator.
"""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from trainkit_strategies.axis import Axis, install
from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.context.huggingface import adopt
from trainkit_strategies.context.ring import CONTEXT, ContextParallel, shard_sequence


class ContextAxis(Axis):
    name = "cp"

    def __init__(self, comm: Comm, parallel: ContextParallel) -> None:
        super().__init__(comm)
        self.parallel = parallel

    @classmethod
    def of(cls, layout: Any) -> ContextAxis | None:
        """For ``layout`` (a ``ParallelStrategy`` whose mesh is made), if it has ``cp`` > 1: attention's traffic on
        the sharding engine's communicator, between the ranks of this cp group."""
        mesh = layout.mesh
        if mesh.layout.cp == 1:
            return None
        shard = mesh.comm(("dp_shard", "cp"))
        ring = [shard.ranks.index(mesh.world.ranks[p]) for p in mesh.layout.group(mesh.world.rank, ("cp",))]
        return cls(mesh.comm("cp"), ContextParallel(shard, layout.cp_method, ring))

    def transform(self, module: nn.Module, device: Any) -> None:
        install(module, CONTEXT, self.parallel)
        adopt(module)  # Hugging Face attention across the cp group, with the rank's positions

    def local_batch(self, batch: Any) -> Any:
        """This rank's two chunks of every sequence (dimension 1 of every tensor of two or more dimensions)."""
        cp = self.parallel
        return apply_to_collection(batch, Tensor, lambda t: shard_sequence(t, cp.rank, cp.size) if t.dim() >= 2
                                   else t)

    def comms(self) -> list[Comm]:
        return []  # its traffic is the sharding engine's communicator's
