"""What Lightning users import from ``lightning.pytorch.utilities``: ``rank_zero_only`` and its kin.

They are lightning-utilities' own (the ones trainkit uses itself), with ``rank_zero_only.rank`` set when trainkit is
imported, from the launcher's variables (``RANK``, else ``SLURM_PROCID``, else ``LOCAL_RANK``; 0 without any), so a
decorated function works before a Trainer exists; each Trainer sets it again to its rank.
"""

from __future__ import annotations

import os

from lightning_utilities.core.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]


def _rank_from_env() -> int:
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


if getattr(rank_zero_only, "rank", None) is None:
    rank_zero_only.rank = _rank_from_env()
