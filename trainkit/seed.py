"""Seeding and the random-number state that resumable checkpoints carry."""

from __future__ import annotations

import base64
import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int | None = None) -> int:
    """Seed python, numpy and torch (all devices); also exported as TRAINKIT_SEED for worker processes and the
    ranks trainkit launches. ``None``, as in Lightning: TRAINKIT_SEED's seed (so a launched rank takes rank 0's),
    else 0. Returns the seed."""
    if seed is None:
        seed = int(os.environ.get("TRAINKIT_SEED", "0"))
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32); got {seed}.")
    os.environ["TRAINKIT_SEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG state, JSON-ready."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "python": [version, list(internal), py_gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_unb64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
