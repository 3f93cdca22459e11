"""The model's transforms, in one place and one order, before the strategy's engine sees the model.

The order is torchtitan's ``parallelize_llama`` (and picotron's ``train.py``), top to bottom:

1. ``configure_model`` builds the layers (on the meta device under the strategy's ``init_context`` where it
   ``BuildsOnMeta``: its ``setup`` then allocates only what this rank keeps, with one-process values);
2. tensor parallelism (``Parallelizes``: the layers of the module's ``tensor_parallel_plan()`` cut to a rank's part),
   then BatchNorm layers synchronised over the data-parallel ranks (``sync_batchnorm``);
3. activation checkpointing (``activation.py``: the repeated blocks recompute in backward);
4. compilation (``compile_blocks``: each repeated block compiled on its own, torchtitan's ``apply_compile``);
5. the strategy's engine (``Strategy.setup``: a pipeline cuts its stages, ddp/ZeRO/FSDP register their hooks).

Compiling before the engine keeps the engine's hooks outside the compiled code: a block's ``forward`` is compiled,
while the module call around it (where sharding gathers parameters and ddp's gradient hooks fire) stays eager, so
compilation composes with every strategy. Context parallelism is a transform too: it installs its group on the
modules, where ``trainkit.parallel.attention`` finds it (``trainkit_strategies/axis.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from trainkit.activation import apply_activation_checkpointing
from trainkit_strategies import BuildsOnMeta, Parallelizes, Strategy, capability
from trainkit_strategies.data_parallel.sync_batchnorm import convert_sync_batchnorm
from trainkit_strategies.sharding.units import repeated_layers
from trainkit_strategies.tensor.regions import run_eagerly_under_compile


def build(module: Any, strategy: Strategy, activation_checkpointing: Any = None, every: int = 1,
          compile: bool = False, sync_batchnorm: bool = False) -> None:
    """Steps 1-4 above on a TrainModule: its layers built, then transformed; ``strategy.setup`` is step 5."""
    on_meta = capability(strategy, BuildsOnMeta)
    with on_meta.init_context() if on_meta is not None else nullcontext():
        module.configure_model()
    parallelize(module, strategy, activation_checkpointing, every, compile, sync_batchnorm)


def parallelize(module: nn.Module, strategy: Strategy, activation_checkpointing: Any = None, every: int = 1,
                compile: bool = False, sync_batchnorm: bool = False) -> None:
    """Steps 2-4: tensor parallelism (where the strategy has an axis for it), BatchNorm synchronised over the
    data-parallel ranks (``sync_batchnorm``), activation checkpointing, compilation."""
    parallelizes = capability(strategy, Parallelizes)
    if parallelizes is not None:
        parallelizes.parallelize(module)
    if sync_batchnorm and strategy.data_comm().active:
        convert_sync_batchnorm(module, strategy.data_comm())
    if activation_checkpointing:
        apply_activation_checkpointing(module, activation_checkpointing, every=every)
    if compile:
        compile_blocks(module)


def compile_blocks(module: nn.Module, compiler: Callable[[Callable], Callable] | None = None) -> int:
    """Compile the ``forward`` of each of ``module``'s repeated blocks (the children of an ``nn.ModuleList`` or
    ``nn.Sequential`` that share a class) on its own; a module with none has its own ``forward`` compiled.

    One block's code is compiled once and reused by every block of its class (their parameters are the compiled
    graph's inputs), so a deep model compiles as fast as a shallow one. Blocks already compiled are left as they
    are. ``compiler``: default ``torch.compile``. Returns how many forwards were compiled.
    """
    compiler = compiler or torch.compile
    run_eagerly_under_compile()
    targets = repeated_layers(module) or [module]
    done = 0
    for block in targets:
        if getattr(block, "_trainkit_compiled", False):
            continue
        if hasattr(block, "_trainkit_recomputed"):  # checkpointed: the code inside the checkpoint is compiled
            block._trainkit_recomputed = compiler(block._trainkit_recomputed)
        else:
            block.forward = compiler(block.forward)
        block._trainkit_compiled = True
        done += 1
    return done
