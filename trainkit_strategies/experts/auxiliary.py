"""Auxiliary losses: terms a layer adds to the training objective from inside the forward (a mixture of experts'
load-balancing and router z-losses), which the step adds to the module's loss before its backward.

A layer calls ``add_auxiliary_loss(t)`` from its forward while the step collects (``collecting(module)``: around
``training_step``, and around each pipeline stage's forward); the step's backward then runs on ``loss +
sum(collected)``, weighted as the loss is (items, accumulation, loss scaling), so a term that is a mean over a rank's
tokens combines across ranks and micro-batches as the loss does. Outside a collecting step (validation, a plain
forward) nothing is kept. The logged loss is the module's own; the layers report their terms themselves
(``trainkit.moe.moe_metrics``). The collector is installed on the module and every module inside it the first time
it collects (``axis.install``), and a layer's term reaches the collector of the module calling
``add_auxiliary_loss`` (``axis.installed``): ranks simulated as threads, each with its own module, keep apart.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Function

from trainkit_strategies.axis import install, installed

COLLECTOR = "auxiliary_collector"  # the attribute it is installed as


class Collector:
    """Where the terms of one module's layers go: ``found`` while its step collects, None otherwise."""

    def __init__(self) -> None:
        self.found: list[tuple[Tensor, int]] | None = None


class _Collecting:
    """One step's collection on a collector (a small object, not a generator: the step enters one every step)."""

    __slots__ = ("collector", "previous")

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def __enter__(self) -> list[tuple[Tensor, int]]:
        collector = self.collector
        self.previous, collector.found = collector.found, []
        return collector.found

    def __exit__(self, *exc: object) -> None:
        self.collector.found = self.previous


def collecting(module: nn.Module) -> _Collecting:
    """Collect the auxiliary losses ``module``'s layers add while inside; yields the list they are appended to, as
    (term, tokens)."""
    collector = module.__dict__.get(COLLECTOR)
    if collector is None:
        collector = Collector()
        install(module, COLLECTOR, collector)
    return _Collecting(collector)


def add_auxiliary_loss(term: Tensor, tokens: int = 1, layer: nn.Module | None = None) -> None:
    """Add ``term`` (a scalar in the autograd graph: a mean over ``tokens`` tokens) to the objective of the step
    collecting the terms of ``layer`` (by default the module calling this), if any. Where no loss is computed beside
    it (a pipeline stage before the last), the term is weighted by its ``tokens`` as the loss is by its items: a
    language model's items are its tokens."""
    collector = installed(COLLECTOR) if layer is None else layer.__dict__.get(COLLECTOR)
    if collector is not None and collector.found is not None and term.requires_grad:
        collector.found.append((term, tokens))


def with_auxiliary(loss: Tensor, found: list[tuple[Tensor, int]]) -> Tensor:
    """``loss`` plus the terms collected for it (weighted as it is)."""
    for term, _ in found:
        loss = loss + term.to(loss.dtype)
    return loss


class _Attached(Function):
    """``x`` unchanged; in backward, ``term`` receives a gradient of one whenever ``x`` receives its gradient (so a
    pipeline stage's auxiliary terms join the backward its output's gradient starts)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, term: Tensor) -> Tensor:
        ctx.like = term
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones_like(ctx.like)


def attached(x: Tensor, found: list[tuple[Tensor, int]], weight: float | Tensor) -> Tensor:
    """``x`` carrying the terms ``found``, each weighted by ``weight`` per token (a pipeline stage's output)."""
    if not found:
        return x
    total = sum(term.float() * tokens for term, tokens in found) * weight
    return _Attached.apply(x, total)
