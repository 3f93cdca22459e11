"""Progress for long work outside the training loop (sampling a dataset, planning strategies): a bar on stderr, on
rank 0, that appears only once the work has taken two seconds (quick work prints nothing), naming what is being
done and how far it is. ``Trainer(enable_progress_bar=False)`` (``--trainer.enable_progress_bar false``) turns it
off, as it turns off the training bar."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_state = {"enabled": os.environ.get("RANK", "0") == "0"}  # rank 0 of a launched run; any process run alone


def show_progress(enabled: bool) -> None:
    """Whether long work shows its progress in this process (the Trainer sets it: its option, on rank 0)."""
    _state["enabled"] = enabled


def tracked(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T] | Iterable[T]:
    """``items``, with a bar naming ``description`` once iterating them has taken two seconds."""
    if not _state["enabled"]:
        return items
    from tqdm.auto import tqdm

    bar: Any = tqdm(items, desc=description, total=total, delay=2.0, mininterval=1.0, leave=False,
                    dynamic_ncols=True, file=sys.stderr)
    return bar
