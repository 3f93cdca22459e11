"""``strategy="auto"``: plan every candidate on a meta copy of the module and one training batch, and take the fastest
that fits the device (``estimate.choose``), saying why."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from trainkit.activation import resolve_mode
from trainkit.errors import ConfigurationError
from trainkit.estimate import (
    AUTO_ORDER,
    choose,
    device_memory_of,
    estimate,
    first_batch,
    human,
    mesh_layouts,
    meta_copy,
)
from trainkit_strategies import Environment, Strategy, get_strategy


def choose_strategy(module: nn.Module, loader: Any, planner: Strategy, env: Environment, precision: str,
                    device_memory: int | None, checkpointing: Any, every: int) -> Strategy:
    """Rank 0 plans on the first batch of ``loader`` (``plan_auto``) and broadcasts its decision through ``planner``
    (the strategy that joined the ranks until now); every rank builds the chosen strategy on ``planner``'s
    communicator. A decision that nothing fits fails on every rank with rank 0's reason."""
    try:
        batch = first_batch(loader)
    except ValueError as err:
        decision: tuple = (None, {}, str(err))
    else:
        decision = plan_auto(module, batch, env.world_size, precision, device_memory or device_memory_of(env.device),
                             checkpointing, every, env.device.type, env.local_world_size or None)
    name, options, message = planner.broadcast_object(decision)
    if name is None:
        raise ConfigurationError(message)
    if env.rank == 0:
        print(message, flush=True)
    chosen = get_strategy(name, **options)
    chosen.setup_environment(env, comm=planner.comm)
    return chosen


def plan_auto(module: nn.Module, batch: Any, world_size: int, precision: str, memory: int,
              checkpointing: Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | str | None, every: int,
              device_type: str, devices_per_node: int | None) -> tuple[str | None, dict[str, Any], str]:
    """The strategy ``strategy="auto"`` takes for ``module`` on ``world_size`` ranks of ``memory`` bytes each:
    ``(name, options, message)``, or ``(None, {}, why none fits)``. Layouts of ``strategy="parallel"`` are planned
    only when no strategy by name fits."""
    model = meta_copy(module)
    with torch.device("meta"):
        model.configure_model()
    mode = resolve_mode(checkpointing) if checkpointing else None

    def plan_with(layouts: list) -> Any:
        return estimate(model, batch, world_size, precision, AUTO_ORDER, memory, checkpointing, device_type, layouts,
                        devices_per_node, every)

    try:
        plan = plan_with([])
        try:
            row = choose(plan, mode)
        except ValueError:  # no one-axis strategy fits: the layouts of strategy="parallel" too
            layouts = mesh_layouts(model, world_size, devices_per_node)
            if not layouts:
                raise
            plan = plan_with(layouts)
            row = choose(plan, mode)
    except ValueError as err:
        return None, {}, str(err)
    needs = ", ".join(f"{r.strategy} {human(r.need(mode))}" for r in plan.rows if r.applies)
    return (row.registered, row.options, f"strategy='auto': {row.describe_choice()}, the fastest plan that fits: "
            f"{human(row.need(mode))} per rank of {human(memory)} ({needs})")
