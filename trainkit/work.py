"""Progress for long work outside the training loop (sampling a dataset, planning strategies): a bar on stderr, on
rank 0, that appears only once the work has taken a second (quick work prints nothing), naming what is being
done and how far it is. ``Trainer(enable_progress_bar=False)`` (``--trainer.enable_progress_bar false``) turns it
off, as it turns off the training bar."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
DELAY_S = 1.0  # work shorter than this shows nothing
TICK_S = 0.5  # how often the bar's clock ticks while one item takes long
_state = {"enabled": os.environ.get("RANK", "0") == "0"}  # rank 0 of a launched run; any process run alone


def show_progress(enabled: bool) -> None:
    """Whether long work shows its progress in this process (the Trainer sets it: its option, on rank 0)."""
    _state["enabled"] = enabled


def tracked(items: Iterable[T], description: str, total: int | None = None,
            label: Callable[[T], str] | None = None) -> Iterator[T] | Iterable[T]:
    """``items``, with a bar naming ``description`` (and ``label(item)``, the item in hand) once iterating them has
    taken a second. The bar's clock ticks every half second, so an item that takes long is not a silence."""
    if not _state["enabled"]:
        return items
    return _tracked(items, description, total if total is not None else _length(items), label)


def _length(items: Iterable[Any]) -> int | None:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None


def _tracked(items: Iterable[T], description: str, total: int | None, label: Callable[[T], str] | None
             ) -> Iterator[T]:
    from tqdm.auto import tqdm

    bar: Any = tqdm(desc=description, total=total, delay=DELAY_S, mininterval=1.0, leave=False, dynamic_ncols=True,
                    file=sys.stderr)
    done = threading.Event()
    threading.Thread(target=_tick, args=(bar, done), name="trainkit-progress", daemon=True).start()
    try:
        for item in items:
            if label is not None:
                bar.set_postfix_str(label(item), refresh=False)
            yield item
            bar.update(1)
    finally:
        done.set()
        bar.close()


def _tick(bar: Any, done: threading.Event, clock: Callable[[], float] = time.time) -> None:
    """Redraw ``bar`` every ``TICK_S`` once it is shown (``DELAY_S`` after it started, on tqdm's clock), until
    ``done``: its elapsed time moves while one item takes long."""
    while not done.wait(TICK_S):
        if clock() - bar.start_t >= DELAY_S:
            bar.refresh()
