"""A stage's backward in two autograd passes, for zero-bubble pipeline schedules (Qi et al., 2024, §2):

- B, ``input_gradient``: the gradient of the stage's input, which the previous stage waits for. It runs only
  the nodes on the path from the output to the input, so no weight gradient is computed; on the way it keeps
  the gradient arriving at each *junction*, a node where a path to some parameter leaves that path (the matrix
  product whose other operand is a weight, say);
- W, ``WeightGradients.run``: later, from the kept junction gradients down to the parameters only. Each
  junction's work is split between the passes (its input part in B, its weight part in W), so the two cost
  what one backward costs.

The graph between the junctions and the parameters, and the activations its nodes saved, stay alive until W
runs; the rest of the stage's graph is freed after B.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: Tensor) -> Node | None:
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # the accumulator exists once something refers to it


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Each node below ``root`` with the nodes that feed it gradients (the graph's edges, reversed)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upward(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` towards the output, not crossing ``stop``; and the ``stop`` nodes met."""
    seen, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


class WeightGradients:
    """The W pass of one micro-batch on one stage: what ``input_gradient`` kept, turned into ``.grad``."""

    def __init__(self, groups: list[tuple[list[Node], list[Tensor]]], grads: dict[Node, tuple]) -> None:
        self.groups, self.grads = groups, grads

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (firing parameters' post-accumulate hooks, as a backward
        does); one autograd pass per group of parameters sharing junctions."""
        for junctions, params in self.groups:
            edges, grads, hooks = [], [], []
            for node in junctions:
                kept = self.grads.get(node)
                if kept is None:
                    continue
                for i, g in enumerate(kept):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
                if len(junctions) > 1:  # a junction below another gets what B gave it, not that plus W's share
                    hooks.append(node.register_prehook(lambda _, kept=kept: kept))
            try:
                if edges:
                    torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)  # freed with the groups
            finally:
                for hook in hooks:
                    hook.remove()
        self.groups, self.grads = [], {}


def input_gradient(output: Tensor, gradient: Tensor | None, inputs: Tensor,
                   params: Sequence[Tensor]) -> tuple[Tensor | None, WeightGradients]:
    """B: the gradient of ``inputs`` (a leaf requiring grad) for ``output`` receiving ``gradient`` (None for a
    scalar loss); and the W pass left for ``params``. Parameters ``output`` does not depend on get nothing, as in
    a backward."""
    root, source = grad_node(output), grad_node(inputs)
    if root is None or source is None:
        raise ValueError("input_gradient needs an output computed from an input that requires grad.")
    parents = _parents(root)
    if source not in parents:  # the output ignores the input: nothing to split, W is the whole backward
        grad = torch.ones_like(output) if gradient is None else gradient
        return None, WeightGradients([([root], [p for p in params if p.requires_grad])], {root: (grad,)})
    on_path, _ = _upward([source], parents, stop=set())  # the nodes B runs
    owner: dict[Node, tuple[list[Node], list[Tensor]]] = {}  # junction -> (junctions, parameters) sharing it
    for p in params:
        node = grad_node(p) if p.requires_grad else None
        if node is None or node not in parents:
            continue
        _, junctions = _upward([node], parents, stop=on_path)
        group: tuple[list[Node], list[Tensor]] = ([], [p])
        for j in junctions:
            other = owner.get(j)
            if other is group:
                continue
            if other is None:
                group[0].append(j)
            else:  # parameters meeting the input's path at a common node are computed together
                group[0].extend(other[0])
                group[1].extend(other[1])
            for n in other[0] if other is not None else [j]:
                owner[n] = group
    kept: dict[Node, tuple] = {}

    def keep(node: Node) -> Any:
        return lambda grad_outputs: kept.__setitem__(node, tuple(grad_outputs))

    hooks = [j.register_prehook(keep(j)) for j in owner]
    try:
        (grad,) = torch.autograd.grad(output, inputs, gradient, retain_graph=True, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    groups = list({id(g): g for g in owner.values()}.values())
    return grad, WeightGradients(groups, kept)
