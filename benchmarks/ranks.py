"""Starting a benchmark's ranks: spawned processes on 127.0.0.1 that hand their results back in a shared dict."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable[..., None], world: int, *args: Any) -> dict:
    """Run ``worker(rank, world, port, *args, out)`` in ``world`` spawned processes (a fresh port each time) and
    return what they put in ``out`` once every one has finished."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(worker, args=(world, free_port(), *args, out), nprocs=world, start_method="spawn")
        return dict(out)
