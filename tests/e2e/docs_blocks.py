"""The fenced blocks of README.md and docs/*.md as things to run: what ``test_docs_run.py`` runs and why it skips.

A block becomes items:

- ``bash``: one item per command (continuation lines joined; comment lines dropped), run by bash in the page's
  working directory, one after another, so a resume runs after the run it resumes.
- ``python``: one item per block, run in one interpreter per page, in document order (a page's snippets continue
  each other as its prose does). A block whose first line is ``# name.py`` is also written to ``name.py``.
- an untagged block whose lines start with ``$ `` is a command followed by its output.
- ``yaml`` / ``toml``: parsed.
- any other untagged block is output or a listing and is not run; when it follows the line
  ``<!-- docs-test: output -->`` it is the output the page's previous item must print.

A block is marked on the line just above its fence with an HTML comment, which the rendered page does not show:
``<!-- docs-test: skip REASON -->`` (not run, for REASON), ``<!-- docs-test: script -->`` (a python block run as its
own script, as a block that launches ranks must be), ``<!-- docs-test: file -->`` (a ``# name.py`` block only
written, for a command to run). Commands are also skipped by the rules of ``skip_reason`` (a GPU, several nodes,
more than 4 processes, the install and the test suite that CI runs itself).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_PROCESSES = 4
MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)[^\n]*$")


@dataclass
class Item:
    page: Path
    line: int  # 1-based line of the command (or of the block's first line) in the page
    kind: str  # "shell", "python", "script", "file", "parse", "output"
    text: str
    lang: str = ""
    skip: str | None = None
    expect: str | None = None  # output the item must print (numbers may differ)
    expect_error: bool = False  # the expected output is an error: the command exits non-zero

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def _commands(body: str, first: int) -> list[tuple[int, str]]:
    """Logical shell commands of a block with their line numbers; comment-only lines dropped."""
    out: list[tuple[int, str]] = []
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while (text.rstrip().endswith("\\") or _open_quote(text)) and i + 1 < len(lines):
            i += 1
            text = text.rstrip().removesuffix("\\").rstrip() + " " + lines[i].strip()
        i += 1
        if text.strip() and not text.lstrip().startswith("#"):
            out.append((first + start, text.strip()))
    return out


def _open_quote(text: str) -> bool:
    """Whether a quotation opened on ``text`` continues on the next line (bash reads on to its end)."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


def _devices(command: str) -> int:
    """Processes a command starts: ``--trainer.devices`` x ``--trainer.num_nodes``, or torchrun's count."""
    words = shlex.split(command, comments=True)
    flags = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    n = int(flags.get("--trainer.devices", flags.get("--nproc-per-node", "1")))
    return n * int(flags.get("--trainer.num_nodes", "1"))


def skip_reason(command: str) -> str | None:
    """Why a documented shell command is not run here, or None."""
    words = command.split()
    if "pip install" in command or "-m venv" in command:
        return "installs into a fresh virtual environment: .ci/run does so on a clean clone"
    if "pytest" in command:
        return "runs the test suite (or part of it), which CI runs itself"
    if "--trainer.accelerator cuda" in command or "--gpu" in words or "gpu_check.py" in command:
        return "needs a GPU (docs/gpu.md; benchmarks/gpu_check.py runs these on one)"
    if words[0] == "tensorboard":
        return "starts the TensorBoard server, which runs until stopped"
    if re.search(r"<[a-z ]+>|\s\.\.\.(\s|$)", command):
        return "a template with a placeholder, not a command"
    if words[:2] == ["python", "benchmarks/link.py"]:
        return "shapes a network link between namespaces: needs root and takes 10-15 minutes"
    if words[0] == "python" and words[1].startswith("benchmarks/"):
        if "--smoke" in words:
            return "run by tests/e2e/test_benchmarks_smoke.py"
        return "a benchmark's full run (minutes); its --smoke run is in tests/e2e/test_benchmarks_smoke.py"
    if re.search(r"checkpoints/epoch=\d+-step=\d+", command):
        return "names a checkpoint of the full run (TRAINKIT_MAX_STEPS stops runs here sooner)"
    if _devices(command) > MAX_PROCESSES:
        return f"starts {_devices(command)} processes (more than {MAX_PROCESSES}; the 2 cores here time out)"
    return None


def _blocks(page: Path) -> list[tuple[int, str, str, str, str]]:
    """(first body line, lang, body, marker kind, marker argument) of each fenced block of ``page``."""
    lines = page.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        mark = MARKER.search(lines[i - 1]) if i else None
        out.append((i + 2, m.group(1), "\n".join(lines[i + 1:j]),
                    mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = j + 1
    return out


def items(page: Path) -> list[Item]:
    """The items of one page, in document order."""
    out: list[Item] = []
    for first, lang, body, mark, arg in _blocks(page):
        skip = arg if mark == "skip" else None
        if mark and mark not in ("skip", "script", "file", "output"):
            raise ValueError(f"{page.name}:{first - 1}: unknown docs-test marker {mark!r}")
        if lang in ("bash", "sh", "shell"):
            if re.search(r"(?m)^(#SBATCH|srun )", body):
                skip = skip or "a SLURM batch script: a job across nodes"
            out += [Item(page, n, "shell", cmd, lang, skip or skip_reason(cmd)) for n, cmd in _commands(body, first)]
        elif lang == "python":
            kind = mark if mark in ("script", "file") else "python"
            out.append(Item(page, first, kind, body, lang, skip))
        elif lang in ("yaml", "toml"):
            out.append(Item(page, first, "parse", body, lang, skip))
        elif lang == "" and body.startswith("$ "):
            for k, chunk in enumerate(re.split(r"(?m)^\$ ", body)[1:]):
                command, _, output = chunk.partition("\n")
                out.append(Item(page, first + k, "shell", command.strip(), "bash", skip or skip_reason(command),
                                expect=output, expect_error="error:" in output))
        elif mark == "output":
            if not out:
                raise ValueError(f"{page.name}:{first}: an output block with nothing before it to have printed it")
            out[-1].expect = body
        else:
            out.append(Item(page, first, "output", body, lang, "output or a listing, not a command"))
    return out


def all_items() -> list[Item]:
    """Every page's items. A command already run word for word on an earlier page is not run again (unless it
    resumes, which depends on what ran before it on its page)."""
    out, first = [], {}
    for item in [item for page in PAGES for item in items(page)]:
        if item.kind == "shell" and not item.skip and item.expect is None and "--ckpt_path" not in item.text:
            words = " ".join(shlex.split(item.text, comments=True))
            if words in first:
                item.skip = f"the same command as {first[words]}, which runs"
            first.setdefault(words, item.id)
        out.append(item)
    return out


def output_pattern(expected: str) -> list[re.Pattern[str]]:
    """One pattern per expected line: whitespace runs match any whitespace, numbers any number (figures and
    counts change with the machine and with the capped steps; the words and their order may not)."""
    number = r"(?<![A-Za-z0-9_.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"  # not the digits of a name (zero2, tp8)
    patterns = []
    for line in expected.strip().split("\n"):
        line = line.strip()
        if not line or line == "...":
            continue
        parts = re.split(f"({number})", line)
        regex = "".join(number if k % 2 else r"\s+".join(map(re.escape, re.split(" +", part)))
                        for k, part in enumerate(parts))
        patterns.append(re.compile(regex))
    return patterns
