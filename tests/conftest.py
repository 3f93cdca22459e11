"""Test-suite configuration: the ``cuda`` marker for what only a GPU can show.

The same ``python -m pytest -q`` runs on a CPU-only machine and on a GPU machine. Single-process tests
train where ``accelerator="auto"`` puts them (the GPU when there is one) and compare on that device;
multi-rank tests run on CUDA only when every rank can have a GPU of its own, on CPU/gloo otherwise
(``tests.helpers.accelerator_for``). Tests marked ``cuda`` exercise CUDA-only paths and are skipped,
with that reason, where no GPU is visible.
"""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: exercises a CUDA-only path; skipped where no GPU is visible")
    config.addinivalue_line("markers", "slow: starts processes of its own (ranks, the CLI, a launcher) or waits out a "
                                       "timeout, or takes tens of seconds; `-m 'not slow'` is the contributor tier")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
