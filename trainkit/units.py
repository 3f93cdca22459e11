"""Sizes as people write and read them: "80GB" in, "1.68 MB" out."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_bytes(size: str | int | float) -> int:
    """Bytes in ``size``: a number, or a string such as "80GB", "24GiB", "512MB"."""
    if isinstance(size, int | float):
        return int(size)
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", size)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"Cannot read the size {size!r}; write it like 80GB, 24GiB or 512MB.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def human_count(n: int) -> str:
    return next((f"{n / size:.2f}{unit}" for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= size), str(n))


def human_or_unknown(n: float | None) -> str:
    return "?" if n is None else human(n)


def human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
