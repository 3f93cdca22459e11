"""The ratios trainkit's strategies must reach against their references, as docs/benchmarks.md#targets lists them.

``strategies.py`` (two ranks on one host, over loopback) and ``link.py`` (ranks on two nodes joined by a shaped link)
print, after their tables, a line for every ratio outside its target, so that a run shows a regression at a glance,
or one line saying every ratio they measured is within. The targets hold for the reference workload, not for
``--smoke``'s tiny model, which checks only that the scripts run.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCH_ZERO = "torch ZeRO (ZeroRedundancyOptimizer+DDP)"
TORCH_FSDP2 = "torch FSDP2 (fully_shard per block)"
LINK_FSDP2 = "torch FSDP2 (per block)"


@dataclass(frozen=True)
class Target:
    """``variant``'s step over ``reference``'s, in the runs of ``where``, is at most ``most``."""

    where: str  # "loopback" (strategies.py), "link 2x1" or "link 2x2" (link.py, at any rate)
    variant: str
    reference: str
    most: float


TARGETS = [
    Target("loopback", "trainkit ddp", "torch DDP", 1.00),
    *(Target("loopback", f"trainkit {name}", TORCH_ZERO, 1.00) for name in ("zero1", "zero2", "zero_offload")),
    *(Target("loopback", f"trainkit {name}", "trainkit ddp", 1.15) for name in ("zero1", "zero2")),
    *(Target("loopback", f"trainkit {name}", TORCH_FSDP2, 0.75) for name in ("fsdp", "zero3")),
    *(Target("loopback", f"trainkit {name}", "trainkit ddp", 1.30) for name in ("fsdp", "zero3")),
    *(Target("loopback", f"trainkit pipeline {s}", f"torch pipelining {s}", 1.00) for s in ("GPipe", "1F1B")),
    Target("link 2x1", "trainkit ddp", "torch DDP", 1.02),
    *(Target("link 2x1", f"trainkit {name}", "trainkit ddp", 1.05) for name in ("zero1", "zero2", "zero_offload")),
    Target("link 2x1", "trainkit fsdp", LINK_FSDP2, 0.62),
    Target("link 2x1", "trainkit zero3", LINK_FSDP2, 0.70),
    *(Target("link 2x1", f"trainkit ddp {name}", "trainkit ddp", 1.00)
      for name in ("powersgd r1", "powersgd r4", "+ 1-bit Adam")),
    Target("link 2x2", "trainkit fsdp (4 ranks)", "torch FSDP2 (4 ranks)", 0.75),
    Target("link 2x2", "trainkit HSDP (shard in node, replicate across)", "trainkit fsdp (4 ranks)", 1.00),
]


def verdict(where: str, ratios: dict[tuple[str, str], float]) -> list[str]:
    """The lines a run of ``where`` prints: one per measured ratio (``ratios[variant, reference]``) above its
    target, or one saying that all of them are within (none when no ratio with a target was measured)."""
    checked = [(t, ratios[(t.variant, t.reference)]) for t in TARGETS
               if t.where == where and (t.variant, t.reference) in ratios]
    missed = [f"outside target: {t.variant} {ratio:.3f}x {t.reference} (target <= {t.most:.2f}, "
              "docs/benchmarks.md#targets)" for t, ratio in checked if ratio > t.most]
    if missed or not checked:
        return missed
    return [f"targets: all {len(checked)} ratios with a documented target are within it"]


SMOKE = "targets: not checked (--smoke runs a tiny model; they hold for the reference workload)"
