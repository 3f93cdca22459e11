"""Every fenced block of README.md and docs/*.md runs as written (docs_blocks.py says how blocks become items).

The rule that keeps this short: ``TRAINKIT_MAX_STEPS=2`` (docs/trainer.md, "Trying a command quickly") stops each
fit two optimizer steps after it starts or resumes and has each evaluation read at most two batches. Each page
runs in a directory of its own holding ``mypkg.py`` (the documents' user package: quickstart.md's regression model
and data), ``train.py`` (cli.md's script), an ``input.txt`` and links to the repository's examples/, benchmarks/ and
tests/. Its Python snippets run in one interpreter, in document order, after a prelude giving them the names their
prose assumes (``PRELUDE``). A command must exit 0 (an expected error output: non-zero) and print any output the page
shows for it, numbers aside, without a silence longer than 5 s.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

from tests.e2e.docs_blocks import PAGES, ROOT, Item, all_items, output_pattern

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

STEPS = "2"
TIMEOUT_S = 150
SILENT_S = 60.0  # a documented command silent this long looks hung to its reader: a hang guard, not a timing (the
# bars that keep long work from being silent are tested on a clock the test moves: tests/unit/test_ticking.py)
FIXTURES = Path(__file__).parent / "docs_fixtures"
PRELUDE = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import trainkit as tk
from mypkg import Regressor, RegressionData, make_data

train_loader = DataLoader(make_data(256), batch_size=32, shuffle=True)   # the loaders the prose assumes
val_loader = test_loader = my_loader = DataLoader(make_data(64, seed=1), batch_size=32)
MyModule, model = Regressor, Regressor()
trainer = tk.Trainer(max_epochs=1, enable_progress_bar=False)
"""
ITEMS = all_items()


@dataclass
class Page:
    """One page's working directory and Python interpreter, and how far through its items it has run."""

    path: Path
    workdir: Path
    done: dict[str, tuple[bool, str]] = field(default_factory=dict)  # item id -> (passed, what to show)
    session: subprocess.Popen | None = None
    silences: dict[str, float] = field(default_factory=dict)  # item id -> longest stretch without output (s)
    answers: int = -1

    def env(self) -> dict[str, str]:
        # torch.compile's cache starts empty, as on a new user's machine and in CI (a warm one hid a hang at exit)
        return {**os.environ, "TRAINKIT_MAX_STEPS": STEPS, "PYTHONPATH": str(self.workdir),
                "TORCHINDUCTOR_CACHE_DIR": str(self.workdir / ".torchinductor"),
                "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}

    def shell(self, item: Item) -> tuple[bool, str]:
        """Runs ``item`` under bash, reading its output as it comes to find its longest silence."""
        proc = subprocess.Popen(["bash", "-c", item.text], cwd=self.workdir, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.stdout is not None
        chunks, last, silence = [], time.monotonic(), 0.0
        deadline = last + TIMEOUT_S
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.killpg(proc.pid, signal.SIGKILL)  # bash and the ranks it started
                proc.wait()
                return False, f"timed out after {TIMEOUT_S} s\n{b''.join(chunks).decode(errors='replace')[-6000:]}"
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            now = time.monotonic()
            silence, last = max(silence, now - last), now
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait()
        self.silences[item.id] = silence
        ok = (code != 0) if item.expect_error else (code == 0)
        shown = f"exit {code}\n{b''.join(chunks).decode(errors='replace')[-6000:]}"
        if ok and silence > SILENT_S:  # long work says what it is doing (a bar, a line per phase)
            return False, f"printed nothing for {silence:.1f} s (more than {SILENT_S} s)\n{shown}"
        return ok, shown

    def python(self, item: Item) -> tuple[bool, str]:
        if self.session is None:
            read, write = os.pipe()
            self.session = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "docs_session.py"), str(write)], cwd=self.workdir,
                env=self.env(), stdin=subprocess.PIPE, text=True, pass_fds=(write,))
            os.close(write)
            self.answers = read
            ok, shown = self._ask(PRELUDE, "prelude")
            assert ok, f"the docs test's prelude failed:\n{shown}"
        return self._ask(item.text, str(item.page.relative_to(ROOT)) + f":{item.line}")

    def _ask(self, code: str, name: str) -> tuple[bool, str]:
        assert self.session is not None and self.session.stdin is not None
        self.session.stdin.write(json.dumps({"code": code, "name": name}) + "\n")
        self.session.stdin.flush()
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.answers], [], [], TIMEOUT_S)
            chunk = os.read(self.answers, 1 << 16) if ready else b""
            if not chunk:
                self.close()
                return False, f"the snippet's interpreter {'timed out' if not ready else 'died'}"
            line += chunk
        answer = json.loads(line)
        return answer["ok"], answer["output"][-6000:] + answer["error"]

    def script(self, item: Item) -> tuple[bool, str]:
        name = f"snippet_{item.line}.py"
        (self.workdir / name).write_text(item.text)
        return self.shell(Item(item.page, item.line, "shell", f"python {name}"))

    def run(self, item: Item) -> tuple[bool, str]:
        if item.kind == "shell":
            ok, shown = self.shell(item)
        elif item.kind == "parse":
            (yaml.safe_load if item.lang == "yaml" else tomllib.loads)(item.text)
            ok, shown = True, ""
        else:
            first = item.text.split("\n", 1)[0]
            if first.startswith("# ") and first.split()[1].endswith(".py"):
                (self.workdir / first.split()[1].rstrip(":")).write_text(item.text)
            if item.kind == "file":
                return True, ""
            ok, shown = self.script(item) if item.kind == "script" else self.python(item)
        if ok and item.expect is not None:
            missing = [p.pattern for p in output_pattern(item.expect) if not p.search(shown)]
            if missing:
                ok, shown = False, f"output lacks {missing}\n{shown}"
        return ok, shown

    def close(self) -> None:
        if self.session is not None:
            self.session.kill()
            self.session.wait()
            os.close(self.answers)
            self.session = None


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    made: dict[Path, Page] = {}

    def page(path: Path) -> Page:
        if path not in made:
            for other in made.values():  # pages run one after another: an earlier page's interpreter is done
                other.close()
            workdir = tmp_path_factory.mktemp(path.stem)
            for name in ("examples", "benchmarks", "tests"):
                (workdir / name).symlink_to(ROOT / name)
            for fixture in FIXTURES.glob("*.py"):
                shutil.copy(fixture, workdir / fixture.name)
            (workdir / "input.txt").write_text("\n".join(p.read_text() for p in PAGES))
            made[path] = Page(path, workdir)
        return made[path]

    yield page
    for p in made.values():
        p.close()
    silences = sorted(((s, i) for p in made.values() for i, s in p.silences.items()), reverse=True)
    print("\nlongest silences:", ", ".join(f"{i} {s:.1f} s" for s, i in silences[:10]))


@pytest.mark.parametrize("item", [i for i in ITEMS if i.kind != "output"], ids=lambda i: i.id)
def test_documented_block_runs(item: Item, pages):
    if item.skip:
        pytest.skip(item.skip)
    page = pages(item.page)
    for earlier in [i for i in ITEMS if i.page == item.page]:  # after the page's earlier blocks, as a reader runs them
        if earlier.id == item.id:
            break
        if earlier.kind != "output" and not earlier.skip and earlier.id not in page.done:
            page.done[earlier.id] = page.run(earlier)
    if item.id not in page.done:
        page.done[item.id] = page.run(item)
    ok, shown = page.done[item.id]
    assert ok, f"{item.page.relative_to(ROOT)}:{item.line}: {item.text}\n{shown}"


def test_every_block_is_run_or_says_why_not():
    """Each fenced block is run, parsed, checked as output, or skipped with a reason; the counts are printed."""
    runnable = [i for i in ITEMS if i.kind != "output" and not i.skip]
    skipped = [i for i in ITEMS if i.kind != "output" and i.skip]
    outputs = [i for i in ITEMS if i.kind == "output"]
    checked = [i for i in runnable if i.expect is not None]
    reasons: dict[str, int] = {}
    for i in skipped:
        reasons[i.skip] = reasons.get(i.skip, 0) + 1
    print(f"\n{len(runnable)} run ({len(checked)} with their output checked), {len(skipped)} skipped, "
          f"{len(outputs)} output or listings, over {len(PAGES)} pages")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d} skipped: {reason}")
    terse = [(i.page.name, i.line, i.skip) for i in skipped if len(str(i.skip).split()) < 3]
    assert not terse, f"skipped without a reason a reader can follow (three words at least): {terse}"
    assert len(runnable) > 100
    assert {i.kind for i in runnable} >= {"shell", "python", "parse"}
