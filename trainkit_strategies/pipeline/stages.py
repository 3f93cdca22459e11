"""Stages: the model's ``pipeline_layers()`` cut into contiguous chunks (balanced by parameters, or as ``split``
says), which pipeline rank holds each parameter, and the modules a rank runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from trainkit_strategies.errors import ConfigurationError
from trainkit_strategies.pipeline.schedules import partition, rank_and_chunk


class Stage(nn.Module):
    """This rank's layers, applied in order."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


class Chunks(nn.Module):
    """This rank's model chunks: ``chunks[c]`` is virtual stage ``c * stages + rank`` of the model."""

    def __init__(self, chunks: Sequence[Sequence[nn.Module]]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(Stage(layers) for layers in chunks)


def cut(sizes: list[int], stages: int, virtual_stages: int, split: list[int] | None) -> list[int]:
    """Layers per chunk, in model order, for layers of parameter counts ``sizes``: ``split`` as given (checked), or the
    partition that minimises the largest chunk."""
    chunks = stages * virtual_stages
    if split is None:
        if len(sizes) < chunks:
            raise ConfigurationError(f"pipeline: {len(sizes)} pipeline_layers() cannot fill {stages} stages x "
                                     f"{virtual_stages} virtual stages = {chunks} chunks of at least one layer.")
        return partition(sizes, chunks)
    if len(split) != chunks or sum(split) != len(sizes) or min(split) < 1:
        raise ConfigurationError(
            f"pipeline split={split} must give each of the {chunks} chunks (stages x virtual_stages) at "
            f"least one layer and add up to the module's {len(sizes)} pipeline_layers().")
    return list(split)


def owners(layers: Sequence[nn.Module], bounds: list[int], stages: int,
           names: dict[nn.Parameter, str]) -> dict[nn.Parameter, set[int]]:
    """The pipeline ranks holding each parameter when chunk ``k`` is ``layers[bounds[k]:bounds[k + 1]]`` (a parameter
    tied across chunks has several); every parameter of ``names`` must be in some layer."""
    rank_of: dict[nn.Parameter, set[int]] = {}
    for k in range(len(bounds) - 1):
        for layer in layers[bounds[k] : bounds[k + 1]]:
            for q in layer.parameters():
                rank_of.setdefault(q, set()).add(rank_and_chunk(k, stages)[0])
    outside = [n for q, n in names.items() if q not in rank_of]
    if outside:
        raise ConfigurationError(
            f"pipeline: parameters outside every layer of pipeline_layers() would never train: "
            f"{', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}. Include the modules holding them in "
            "pipeline_layers(), or freeze them (requires_grad=False) and keep them out of the optimizer."
        )
    return rank_of
