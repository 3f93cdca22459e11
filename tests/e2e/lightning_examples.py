"""examples/lightning/ as Lightning files and as runs: docs/lightning.md's rename table, read from the page and
applied either way, the command line each example runs with in a few seconds on a CPU, and the values a run logs.

The examples are trainkit files. Renamed by the page's table in reverse they are Lightning files, and the table
turns those back into the examples exactly: so what the page promises ("nothing changed but these names") is what
the tests run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "lightning"
PAGE = ROOT / "docs" / "lightning.md"
NAMES = ("autoencoder", "gan", "finetuning")

# The command line of each example in both frameworks (the same flags: LightningCLI's and trainkit's CLI agree)
# for a run of seconds, and the tags each logs.
ARGS = {
    "autoencoder": ["--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1",
                    "--trainer.enable_progress_bar", "false"],
    "gan": ["--max_epochs", "2", "--log_every_n_steps", "1"],
    "finetuning": ["fit", "--trainer.max_epochs", "3", "--finetuning.milestones", "[1,2]",
                   "--trainer.limit_train_batches", "12", "--trainer.log_every_n_steps", "1",
                   "--trainer.enable_progress_bar", "false"],
}
TAGS = {
    "autoencoder": ("train_loss", "val_loss_step", "val_loss_epoch", "test_loss_step", "test_loss_epoch"),
    "gan": ("g_loss", "d_loss"),
    "finetuning": ("train_loss", "train_acc", "val_loss", "val_acc"),
}
# Epoch aggregates (means over an epoch's batches): trainkit sums them in fp64, Lightning in fp32, a last bit apart.
AGGREGATES = {"val_loss_epoch", "test_loss_epoch", "val_loss", "val_acc"}


def rename_table(page: Path = PAGE) -> list[tuple[str, str]]:
    """The (Lightning name, trainkit name) rows of the page's table headed ``| Lightning | trainkit |``."""
    rows, inside = [], False
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells == ["Lightning", "trainkit"]:
            inside = True
        elif inside and not cells:
            break
        elif inside and not set(line) <= set("|- "):
            names = [re.fullmatch(r"`([\w.]+)`", c) for c in cells]
            if len(names) != 2 or not all(names):
                raise ValueError(f"{page.name}: a rename row is two names in backticks; got {line!r}")
            rows.append((names[0][1], names[1][1]))
    if not rows:
        raise ValueError(f"{page.name} has no table headed | Lightning | trainkit |")
    return rows


def _rename(text: str, pairs: dict[str, str]) -> str:
    """Whole names only (``DataModule`` but not ``MyDataModule``), the longest first, in one pass."""
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(pairs, key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: pairs[m[1]], text)


def to_trainkit(text: str) -> str:
    return _rename(text, dict(rename_table()))


def to_lightning(text: str) -> str:
    """The reverse renaming, into the ``pytorch_lightning`` spelling (the package pip installs)."""
    return _rename(text, {tk: pl for pl, tk in rename_table() if not pl.startswith("lightning.")})


def command(name: str, script: Path, devices: int) -> list[str]:
    """The example's command line on the CPU. Several processes run ddp with every one reading all the data: their
    gradients are equal, so their average is each one's exactly and the run must log the one-process values.
    (Sharded, the data would reach trainkit's ranks in another order than Lightning's: under DDP Lightning shuffles
    a training loader that does not shuffle; docs/lightning.md.)"""
    flag = "--" if name == "gan" else "--trainer."
    hardware = [f"{flag}accelerator", "cpu", f"{flag}devices", str(devices)]
    if devices > 1:
        hardware += [f"{flag}strategy", "ddp", f"{flag}use_distributed_sampler", "false"]
    return [sys.executable, str(script), *ARGS[name], *hardware]


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    """Run a script as a user does, in ``cwd`` (where both frameworks put their logs), one thread per process so
    that both frameworks compute alike; returns its standard output."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def logged(root: Path) -> dict[str, list[float]]:
    """Every scalar in the TensorBoard event files under ``root``, per tag in the order written (all of them: a step
    number that goes back, as a per-batch validation curve's may, is not taken for a restart to purge)."""
    files = []
    for path in root.rglob("events.out.tfevents.*"):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0}, purge_orphaned_data=False)
        events.Reload()
        series = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
        first = min((s[0].wall_time for s in series.values() if s), default=0.0)
        files.append((first, series))
    out: dict[str, list[float]] = {}
    for _, series in sorted(files, key=lambda f: f[0]):
        for tag, scalars in series.items():
            out.setdefault(tag, []).extend(e.value for e in scalars)
    return out


def printed_tensor(stdout: str) -> str:
    """The first tensor a script printed (the autoencoder prints its first batch of predictions)."""
    found = re.search(r"tensor\(\[\[.*?\]\]\)", stdout, re.DOTALL)
    assert found, stdout[-2000:]
    return found[0]
