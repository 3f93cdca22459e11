"""Which tensor-parallel plan a module has (its own, or its Hugging Face model's), whether it can be split over
``tp`` ranks, and a model cut as one rank computes it, for planning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainkit_strategies.communication.comm import Comm
from trainkit_strategies.communication.plan_comm import PlanComm
from trainkit_strategies.tensor.huggingface import indivisible_heads
from trainkit_strategies.tensor.huggingface import plan_of as hf_plan_of
from trainkit_strategies.tensor.plan import apply_plan


def plan_for(module: nn.Module) -> Mapping[str, Any] | None:
    """The module's ``tensor_parallel_plan()``, or else the plan of the Hugging Face models it holds (their own,
    with the entries sequence parallelism needs: ``tensor/huggingface.py``), or None."""
    plan = getattr(module, "tensor_parallel_plan", None)
    return plan() if callable(plan) else hf_plan_of(module)


def unplanned(module: nn.Module, tp: int) -> str | None:
    if tp <= 1:
        return None
    try:
        found = plan_for(module)
    except ValueError as err:
        return str(err)
    return indivisible_heads(module, tp) if found is not None else "the module has no tensor_parallel_plan()"


def split_for_trace(model: nn.Module, tp: int, sequence_parallel: bool, device: torch.device) -> nn.Module:
    """``model`` with its plan applied as one tensor-parallel rank computes it, over a ``PlanComm`` (collectives
    counted, none performed: the shapes and the bytes saved for backward are a rank's)."""
    if tp > 1:
        apply_plan(model, plan_for(model) or {}, PlanComm(tp, 0, device), sequence_parallel)
    return model


def same_start(module: nn.Module, comm: Comm, device: torch.device) -> None:
    """Every rank of ``comm`` (a tensor- or expert-parallel group) takes the group's first rank's values before it
    cuts its part (a rank that drew other initial values would otherwise train a model no single process has)."""
    with torch.no_grad():
        for p in module.parameters():
            if not p.is_meta:
                on_device = p.data.to(device)
                comm.broadcast(on_device, src=0)
                p.data.copy_(on_device)
