"""The benchmarks' targets: the line a run prints for a ratio outside one, and docs/benchmarks.md's list of them."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import targets  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)


def test_a_ratio_above_its_target_is_named_and_one_at_it_is_not():
    ratios = {("trainkit zero2", "trainkit ddp"): 1.588, ("trainkit zero1", "trainkit ddp"): 1.05,
              ("trainkit ddp", "torch DDP"): 1.001}
    lines = targets.verdict("link 2x1", ratios)
    assert lines == ["outside target: trainkit zero2 1.588x trainkit ddp (target <= 1.05, docs/benchmarks.md#targets)"]
    ratios[("trainkit zero2", "trainkit ddp")] = 0.995
    assert targets.verdict("link 2x1", ratios) == ["targets: all 3 ratios with a documented target are within it"]


def test_ratios_without_a_target_here_print_nothing():
    assert targets.verdict("link cp", {("trainkit cp2 ulysses", "trainkit cp2 ring"): 0.8}) == []
    assert targets.verdict("loopback", {("trainkit zero2", "trainkit ddp"): 2.0})[0].startswith("outside target")
    assert targets.verdict("link 2x1", {("trainkit zero2", "torch DDP"): 2.0}) == []  # not its reference


def test_the_docs_list_every_target_and_no_other():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text.split("## Targets", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| run ")]
    documented = [(where, variant, reference, float(most)) for where, variant, reference, most in rows]
    assert documented == [(t.where, t.variant, t.reference, t.most) for t in targets.TARGETS]
