"""The project's documents stand on their own: nothing cites design notes that are not in the repository (the
project's design is docs/architecture.md), every relative link between its markdown files resolves, and every
source file they name exists."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = [p for folder in ("trainkit", "trainkit_strategies", "tests", "benchmarks", "examples", "docs")
         for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")] + [ROOT / "README.md"]


def test_no_file_cites_design_notes_outside_the_repository():
    outside = ["DESIGN" + ".md", "STYLE" + ".md"]  # spelled apart so this file does not cite them
    citing = sorted(str(p.relative_to(ROOT)) for p in FILES if any(name in p.read_text() for name in outside))
    assert not citing, f"cite notes that are not in the repository: {citing}"


def test_relative_links_between_documents_resolve():
    broken = []
    for page in [p for p in FILES if p.suffix == ".md"]:
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http") and not (page.parent / target).resolve().is_file():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def _prose(text: str) -> list[str]:
    """The lines of a markdown page with its fenced blocks blanked (a ``# name.py`` in a block is no heading)."""
    lines, fenced = [], False
    for line in text.split("\n"):
        fence = line.lstrip().startswith("```")
        fenced ^= fence
        lines.append("" if fenced or fence else line)
    return lines


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lowercased, punctuation and symbols dropped (``-`` and ``_``
    kept), spaces made hyphens, and ``-1``, ``-2`` after a repeated one."""
    anchors, seen = set(), {}
    for line in _prose(page.read_text()):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = "".join(c for c in heading.group(1).lower()
                           if c in " -_" or unicodedata.category(c)[0] in "LNM").replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_to_a_section_finds_its_heading():
    """``[..](page.md#anchor)`` and ``[..](#anchor)`` name a heading of that page: a section moved to another page
    takes its links with it. The count guards against a pattern that silently matches nothing."""
    broken, checked = [], 0
    for page in [p for p in FILES if p.suffix == ".md"]:
        for n, line in enumerate(_prose(page.read_text()), 1):
            for target, anchor in re.findall(r"\]\(([^)#\s]*\.md|)#([^)\s]+)\)", line):
                checked += 1
                dest = page.parent / target if target else page
                if dest.is_file() and anchor not in _anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}:{n} -> {target}#{anchor}")
    assert checked > 100 and not broken, broken


MAX_LINES = 600


def test_no_page_is_longer_than_a_reader_can_hold():
    """A page of docs/ (or the README) has at most ``MAX_LINES`` lines: strategies.md had grown to 1,844 before it
    was split into an overview and a page per family of strategies; reference.md, benchmarks.md and distributed.md
    were split the same way (trainer.md, benchmarks-network.md, fault-tolerance.md)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    long = {p.name: n for p in pages if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by topic (pages over {MAX_LINES} lines): {long}"


def test_the_readme_lists_every_page():
    """The README's Documentation list is the index of docs/: a page split out of another is listed there too."""
    index = (ROOT / "README.md").read_text().split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\]\(docs/([^)#\s]+\.md)\)", index))
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in listed) == []

OUTSIDE = {"zero_to_fp32.py"}  # DeepSpeed's, named as the thing trainkit does differently


def test_every_source_file_the_documents_name_exists():
    """A file named in backticks (``comm.py``, ``sharding/engine.py``, ``trainkit_strategies/offload/csrc/host_adam.c``)
    is a file of the repository, by its path or the end of it: documents that name files since moved mislead."""
    tracked = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
               if p.is_file() and not {".git", ".venv", "runs", "checkpoints"} & set(p.relative_to(ROOT).parts)]
    missing = []
    for page in [p for p in FILES if p.suffix == ".md"]:
        for name in re.findall(r"`([A-Za-z0-9_./-]+\.(?:py|c|toml))`", page.read_text()):
            if name not in OUTSIDE and not any(r == name or r.endswith("/" + name) for r in tracked):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_the_docs_test_reads_commands_markers_and_outputs_as_a_reader_does(tmp_path):
    """tests/e2e/test_docs_run.py's reading of a page: a command continued with backslashes or inside a quotation is
    one command, a marker skips its block with its reason, an output block binds to the command above it, and an
    output's numbers are free while its words are not."""
    from tests.e2e.docs_blocks import items, output_pattern

    page = tmp_path / "page.md"
    page.write_text("```bash\ntrainkit fit --a 1 \\\n  --b '{\"x\": 1,\n  \"y\": 2}'  # note\n# a comment\n"
                    "trainkit fit --trainer.devices 8\n```\n\n<!-- docs-test: output -->\n```\nloss 2.5 nats\n```\n"
                    "<!-- docs-test: skip a signature -->\n```python\nf(x, y=1)\n```\n```\n$ trainkit estimate\n"
                    "zero2 20.19 MB\n```\n")
    got = items(page)
    assert [(i.kind, i.line, i.skip) for i in got] == [
        ("shell", 2, None), ("shell", 6, "starts 8 processes (more than 4; the 2 cores here time out)"),
        ("python", 15, "a signature"), ("shell", 18, None)]
    assert got[0].text == 'trainkit fit --a 1 --b \'{"x": 1, "y": 2}\'  # note' and got[1].expect == "loss 2.5 nats"
    [pattern] = output_pattern(got[3].expect)
    assert pattern.search("zero2   9.50 MB")
    assert not pattern.search("zero1 9.50 MB") and not pattern.search("zero2 9 KB")
