"""Asynchronous checkpoints: the same files as synchronous ones, visible only once durable, and a crash
during the background write leaves the previous checkpoint and ``latest`` intact and loadable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import trainkit as tk
from tests.e2e.cli_runs import ROOT, tensors
from tests.helpers import Recorder, Regression, loader, regression_data
from trainkit import checkpoint as ckpt
from trainkit.callbacks import Callback, ModelCheckpoint


def _fit(root: Path, async_save: bool, callbacks: tuple = (), max_steps: int = 8,
         ckpt_path: str | None = None) -> tk.Trainer:
    trainer = tk.Trainer(max_steps=max_steps, seed=1, logger=False, enable_progress_bar=False, default_root_dir=root,
                         callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, async_save=async_save),
                                    *callbacks])
    trainer.fit(Regression(dropout=0.1), loader(regression_data(64), 4, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def test_async_checkpoints_hold_what_sync_ones_hold(tmp_path):
    sync_losses, async_losses = Recorder(), Recorder()
    _fit(tmp_path / "sync", False, (sync_losses,))
    _fit(tmp_path / "async", True, (async_losses,))
    assert async_losses.losses == sync_losses.losses  # training went on unchanged while files were written
    names = [p.name for p in ckpt.listing(tmp_path / "sync" / "checkpoints")]
    assert names == [p.name for p in ckpt.listing(tmp_path / "async" / "checkpoints")] and len(names) == 4
    for name in names:
        want, got = (tensors(tmp_path / run / "checkpoints" / name) for run in ("sync", "async"))
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), name
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text() == names[-1]
    resumed = _fit(tmp_path / "async", True, max_steps=10, ckpt_path="last")  # an async checkpoint resumes
    assert resumed.global_step == 10


class Watch(Callback):
    """What is visible right after each save call returns (the callback runs after ModelCheckpoint)."""

    def __init__(self, root: Path) -> None:
        self.root, self.seen = root, {}

    def on_train_step_end(self, trainer, module, timing) -> None:
        step = trainer.global_step
        if step % 2 == 0 and step not in self.seen:
            latest = self.root / "checkpoints" / "latest"
            self.seen[step] = latest.read_text() if latest.exists() else None


def test_a_checkpoint_appears_only_when_its_files_are_durable(tmp_path, monkeypatch):
    real_save = ckpt.write_safetensors

    def slow_save(path, tensors):
        time.sleep(0.4)  # longer than a few training steps here
        return real_save(path, tensors)

    monkeypatch.setattr(ckpt, "write_safetensors", slow_save)
    watch = Watch(tmp_path)
    _fit(tmp_path, True, (watch,))
    assert watch.seen[2] is None  # the first save returned before its checkpoint existed
    assert watch.seen[4] == "epoch=0-step=2"  # the next save waited for (and committed) the one before
    assert (tmp_path / "checkpoints" / "latest").read_text() == "epoch=0-step=8"  # committed by the end of fit


CRASH_SCRIPT = '''
import os, signal, sys
import trainkit as tk
from trainkit import checkpoint as ckpt
from trainkit.callbacks import ModelCheckpoint
from tests.helpers import Regression, loader, regression_data

calls = []
real_save = ckpt.write_safetensors

def save_then_die(path, tensors):
    calls.append(path)
    digest = real_save(path, tensors)
    if len(calls) == 2:  # the second checkpoint: a partial file, then the process is killed mid-write
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return digest

ckpt.write_safetensors = save_then_die
trainer = tk.Trainer(max_steps=8, seed=1, logger=False, enable_progress_bar=False, default_root_dir=sys.argv[1],
                     callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, async_save=True)])
trainer.fit(Regression(), loader(regression_data(64), 4, shuffle=True))
'''


@pytest.mark.slow
def test_a_crash_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == -9, proc.stderr[-3000:]
    dirpath = tmp_path / "checkpoints"
    assert (dirpath / "latest").read_text() == "epoch=0-step=2"
    assert [p.name for p in ckpt.listing(dirpath)] == ["epoch=0-step=2"]
    assert (dirpath / ".tmp-epoch=0-step=4").is_dir()  # the interrupted write, never committed
    reader = ckpt.CheckpointReader(ckpt.latest(dirpath))
    assert reader.meta["loop"]["global_step"] == 2
    resumed = _fit(tmp_path, True, ckpt_path="last")
    assert resumed.global_step == 8
    assert ckpt.latest(dirpath).name == "epoch=0-step=8"


class WatchAll(Callback):
    """On rank 0: at every step boundary, what ``latest`` names and whether rank 1 had made its file of that
    checkpoint durable by then (rank 1 leaves a marker once its write is fsynced)."""

    def __init__(self, root: Path) -> None:
        self.root, self.seen = root, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != 0:
            return
        latest = self.root / "checkpoints" / "latest"
        name = latest.read_text() if latest.exists() else None
        self.seen.append((trainer.global_step, name, name is not None and (self.root / f"durable-{name}").exists()))


def _slow_rank(rank: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if rank == 1:  # rank 1's disk is slow: its file of every checkpoint takes a second and a half
        real_write = ckpt.write_rank_file

        def slow(tmp, r, pieces):
            time.sleep(1.5)
            written = real_write(tmp, r, pieces)
            Path(root, f"durable-{tmp.name.removeprefix('.tmp-')}").touch()
            return written

        ckpt.write_rank_file = slow
    watch = WatchAll(Path(root))
    trainer = tk.Trainer(max_steps=12, seed=1, logger=False, enable_progress_bar=False, default_root_dir=root,
                         accelerator="cpu", timeout_s=120,
                         callbacks=[ModelCheckpoint(every_n_train_steps=4, save_top_k=-1, async_save=True), watch])
    trainer.fit(Regression(), loader(regression_data(256), 4, shuffle=True))
    if rank == 0:
        Path(root, "seen.txt").write_text("\n".join(f"{s} {n} {d}" for s, n, d in watch.seen))
    os._exit(0)


@pytest.mark.slow
def test_latest_lags_until_every_rank_has_made_its_file_durable(tmp_path):
    """Two ranks, rank 1 writing slowly: ``latest`` moves to a checkpoint only once rank 1's file of it is durable,
    so it lags behind the saves by the slow rank's write, and every save is committed by the end of fit."""
    import torch.multiprocessing as mp

    from tests.parity.harness import free_port

    ctx = mp.start_processes(_slow_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=2):
        assert time.monotonic() < deadline, "the ranks did not finish"
    seen = [line.split() for line in (tmp_path / "seen.txt").read_text().splitlines()]
    moved = {name: int(step) for step, name, _ in reversed(seen) if name != "None"}
    assert all(durable == "True" for _, name, durable in seen if name != "None"), seen
    assert moved, "latest never moved during training"
    first = min(moved.values())
    assert first > 4, f"latest moved at step {first}, before rank 1's slow write of the step-4 checkpoint"
    names = [p.name for p in ckpt.listing(tmp_path / "checkpoints")]
    assert names == ["epoch=0-step=4", "epoch=0-step=8", "epoch=0-step=12"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "epoch=0-step=12"
