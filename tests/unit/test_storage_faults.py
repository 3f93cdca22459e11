"""Storage faults are one clear error: found when a fit starts where they can be (an unwritable directory, too little
room, a file-size limit), and on a save that fails (a full disk) the error names the intact previous checkpoint and
no half-written ``.tmp-*`` stays behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from tests.helpers import Recorder, Regression, loader, quiet_trainer, regression_data
from trainkit import checkpoint as ckpt
from trainkit.callbacks import ModelCheckpoint
from trainkit.checkpoint import CheckpointError, latest, listing
from trainkit.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]


def trainer(root: Path, **kwargs):
    recorder = Recorder()
    settings = {"max_steps": 4} | kwargs
    return quiet_trainer(root, callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1), recorder],
                         **settings), recorder


def test_an_unwritable_directory_is_found_before_any_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run, recorder = trainer(blocker / "run")  # works as root too, where permission bits do not stop a write
    with pytest.raises(ConfigurationError, match=r"Checkpoints cannot be written to .*a-file/run/checkpoints: .*"
                                                 r"ENOTDIR.*writable directory"):
        run.fit(Regression(), loader(regression_data(), 4))
    assert recorder.losses == []


def test_too_little_room_is_found_before_any_step(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("trainkit.storage.shutil.disk_usage", lambda path: usage(10_000, 9_900, 100))
    run, recorder = trainer(tmp_path)
    with pytest.raises(ConfigurationError, match=r"has 100 B free, and one checkpoint of this run takes about 1\.9 KB"):
        run.fit(Regression(), loader(regression_data(), 4))
    assert recorder.losses == []


def test_a_full_disk_on_a_save_is_one_error_naming_the_intact_checkpoint(tmp_path, monkeypatch):
    calls = []
    real = ckpt.write_safetensors

    def fills_up(path, tensors):
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:
                f.write(b"half")  # a partial file, as a full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, tensors)

    monkeypatch.setattr(ckpt, "write_safetensors", fills_up)
    run, _ = trainer(tmp_path)
    with pytest.raises(CheckpointError, match=r"epoch=0-step=3 failed \(rank 0: the disk is full .*\[ENOSPC\]\); the "
                                              r"previous checkpoint .* unchanged\. The last committed checkpoint, "
                                              r".*epoch=0-step=2, is intact"):
        run.fit(Regression(), loader(regression_data(), 4))
    checkpoints = tmp_path / "checkpoints"
    assert latest(checkpoints).name == "epoch=0-step=2"
    assert [p.name for p in listing(checkpoints)] == ["epoch=0-step=1", "epoch=0-step=2"]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp")) == []


def test_leftovers_of_an_interrupted_save_are_swept_when_the_next_fit_starts(tmp_path):
    run, _ = trainer(tmp_path)
    run.fit(Regression(), loader(regression_data(), 4))
    leftover = tmp_path / "checkpoints" / ".tmp-epoch=0-step=9"
    leftover.mkdir()
    (leftover / "rank00000.safetensors").write_bytes(b"\0" * 4096)
    again, _ = trainer(tmp_path, max_steps=6)
    again.fit(Regression(), loader(regression_data(), 4), ckpt_path="last")
    assert not leftover.exists()
    assert latest(tmp_path / "checkpoints").name == "epoch=0-step=6"


FILE_SIZE_LIMIT = """
import resource, sys
sys.path.insert(0, {root!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
from tests.unit.test_storage_faults import trainer
from tests.helpers import Regression, loader, regression_data
from pathlib import Path
run, recorder = trainer(Path({root_dir!r}))
run.fit(Regression(), loader(regression_data(), 4))
"""


def test_a_file_size_limit_below_a_checkpoint_file_is_found_before_any_step(tmp_path):
    script = FILE_SIZE_LIMIT.format(root=str(ROOT), root_dir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ConfigurationError: Files may not grow past 1.0 KB here (ulimit -f)" in proc.stderr, proc.stderr[-2000:]
    assert listing(tmp_path / "checkpoints") == []
