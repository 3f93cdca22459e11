"""A directory holds one run's checkpoints: a fresh run leaves an earlier run's files byte-identical, a resumed run
never replaces a newer checkpoint, and a directory in use by a live run is refused."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Regression, loader, quiet_trainer, regression_data
from trainkit.callbacks import ModelCheckpoint
from trainkit.checkpoint import CheckpointReader, latest, listing
from trainkit.errors import ConfigurationError


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def fit(root: Path, max_steps: int, lr: float = 1e-2, **kwargs) -> None:
    trainer = quiet_trainer(root, max_steps=max_steps, callbacks=[ModelCheckpoint(every_n_train_steps=2,
                                                                                  save_top_k=-1)])
    trainer.fit(Regression(lr=lr), loader(regression_data(), 4), **kwargs)


def test_a_fresh_run_leaves_an_earlier_runs_files_byte_identical(tmp_path, capsys):
    fit(tmp_path, 6)
    before = digests(tmp_path)
    fit(tmp_path, 4, lr=0.1)  # other options, the same directory: it used to replace all three checkpoints
    after = digests(tmp_path)
    assert {k: after[k] for k in before} == before
    assert [p.name for p in listing(tmp_path / "checkpoints-v1")] == ["epoch=0-step=2", "epoch=0-step=4"]
    assert "this run writes its own to" in capsys.readouterr().out
    fit(tmp_path, 8, ckpt_path="last")  # the newest run's newest checkpoint, in that run's directory
    assert latest(tmp_path / "checkpoints-v1").name == "epoch=0-step=8"
    assert {k: digests(tmp_path)[k] for k in before} == before


def test_resuming_an_older_checkpoint_writes_new_names(tmp_path):
    fit(tmp_path, 6)
    before = digests(tmp_path)
    fit(tmp_path, 8, ckpt_path=tmp_path / "checkpoints" / "epoch=0-step=2")
    after = digests(tmp_path)
    assert {k: after[k] for k in before if k != "checkpoints/latest"} == \
        {k: v for k, v in before.items() if k != "checkpoints/latest"}
    names = {p.name for p in listing(tmp_path / "checkpoints")}
    assert names == {"epoch=0-step=2", "epoch=0-step=4", "epoch=0-step=6", "epoch=0-step=4-v1", "epoch=0-step=6-v1",
                     "epoch=0-step=8"}
    assert CheckpointReader(tmp_path / "checkpoints" / "epoch=0-step=6-v1").meta["loop"]["global_step"] == 6


def test_a_directory_in_use_by_a_live_run_is_refused(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (directory / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid, "since": "now"}))
        with pytest.raises(ConfigurationError, match=rf"in use by another run \(host {socket.gethostname()}, PID "
                                                     rf"{live.pid}"):
            fit(tmp_path, 2)
    finally:
        live.kill()
        live.wait()
    assert listing(directory) == [] and (directory / ".lock").exists()  # the holder's lock stays


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "since": "then"}))
    fit(tmp_path, 2)
    assert "taking over" in capsys.readouterr().err
    assert latest(directory).name == "epoch=0-step=2"
    assert not (directory / ".lock").exists()  # released when the fit ended
