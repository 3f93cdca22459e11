"""Corrupt, truncated and half-written checkpoints: clear errors, and nothing saved is lost."""

from __future__ import annotations

import json

import pytest
import torch

import trainkit as tk
from tests.helpers import Regression, loader, regression_data
from trainkit import checkpoint as ckpt
from trainkit.callbacks import ModelCheckpoint


def _train(tmp_path, max_steps: int, ckpt_path: str | None = None, every: int = 10) -> tk.Trainer:
    trainer = tk.Trainer(
        max_steps=max_steps, seed=0, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(every_n_train_steps=every, save_top_k=-1)],
    )
    trainer.fit(Regression(), loader(regression_data(64), 4, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def _rank_file(path):
    return path / "rank00000.safetensors"


@pytest.mark.slow
def test_byte_flip_is_detected_and_names_the_file(tmp_path):
    _train(tmp_path, 20)
    good, bad = tmp_path / "checkpoints" / "epoch=0-step=10", tmp_path / "checkpoints" / "epoch=1-step=20"
    data = bytearray(_rank_file(bad).read_bytes())
    data[len(data) // 2] ^= 0x40
    _rank_file(bad).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"rank00000\.safetensors is corrupt: sha256 mismatch") as err:
        _train(tmp_path, 30, ckpt_path="last")
    assert str(_rank_file(bad)) in str(err.value)
    assert "epoch=0-step=10" in str(err.value)  # names the checkpoint to fall back on
    resumed = _train(tmp_path, 30, ckpt_path=str(good))
    assert resumed.global_step == 30


@pytest.mark.slow
def test_truncation_is_detected_and_names_the_file(tmp_path):
    _train(tmp_path, 10)
    path = tmp_path / "checkpoints" / "epoch=0-step=10"
    size = _rank_file(path).stat().st_size
    with open(_rank_file(path), "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ckpt.CheckpointError, match=rf"{size - 100} bytes, expected {size}") as err:
        _train(tmp_path, 20, ckpt_path=str(path))
    assert str(_rank_file(path)) in str(err.value)


@pytest.mark.slow
def test_altered_meta_json_is_detected(tmp_path):
    _train(tmp_path, 10)
    meta_path = tmp_path / "checkpoints" / "epoch=0-step=10" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["loop"]["global_step"] = 3
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"meta\.json is corrupt"):
        _train(tmp_path, 20, ckpt_path="last")


@pytest.mark.slow
def test_crash_mid_write_keeps_latest_on_previous_checkpoint(tmp_path, monkeypatch):
    _train(tmp_path, 10)
    dirpath = tmp_path / "checkpoints"
    assert (dirpath / "latest").read_text() == "epoch=0-step=10"
    real_save = ckpt.write_safetensors

    def crash_half_way(path, tensors):
        real_save(path, tensors)
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "write_safetensors", crash_half_way)
    with pytest.raises(ckpt.CheckpointError, match=r"disk full \(simulated\).*epoch=0-step=10, is intact"):
        _train(tmp_path, 20, ckpt_path="last")
    assert not [p for p in dirpath.iterdir() if p.name.startswith(".tmp-")]  # the half-written file is gone
    monkeypatch.undo()
    assert (dirpath / "latest").read_text() == "epoch=0-step=10"
    assert [p.name for p in ckpt.listing(dirpath)] == ["epoch=0-step=10"]
    reader = ckpt.CheckpointReader(ckpt.latest(dirpath))
    assert reader.meta["loop"]["global_step"] == 10
    module = Regression()
    tk.Trainer(logger=False, enable_progress_bar=False, default_root_dir=tmp_path).validate(
        module, loader(regression_data(16), 8), ckpt_path="last"
    )
    saved = reader.full("model/net.0.weight")
    assert torch.equal(module.net[0].weight.cpu(), saved)
    assert not torch.equal(Regression().net[0].weight, saved)
    resumed = _train(tmp_path, 20, ckpt_path="last")
    assert resumed.global_step == 20


@pytest.mark.slow
def test_a_checkpoint_of_another_model_ends_in_one_error_block(tmp_path):
    """Resumed into another configuration of the model, the run lists what does not fit, names the checkpoint and
    the fix, in one ``trainkit: error`` block (no traceback)."""
    import os
    import subprocess
    import sys

    from tests.e2e.cli_runs import ROOT, fit

    fit(tmp_path, "single", 1, 10, 8)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.default_root_dir", str(tmp_path),
         "--trainer.max_steps", "20", "--trainer.enable_progress_bar", "false",
         "--data", "trainkit.demo.markov.MarkovData", "--data.train_sequences", "640", "--model.n_embd", "32",
         "--ckpt_path", "last"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("trainkit: error") == 1
    assert "checkpoints/epoch=0-step=10 was saved from another model than this one" in proc.stderr
    assert "model.wte.weight: checkpoint shape (16, 64), model shape (16, 32)" in proc.stderr
    assert "Load it into the model it was trained with" in proc.stderr


class _Crash(BaseException):
    """The process dies here."""


def _save_values(dirpath, name: str, value: float) -> None:
    from trainkit_strategies import Environment, get_strategy
    from trainkit_strategies.state.pieces import Piece

    strategy = get_strategy("single")
    strategy.setup_environment(Environment())
    data = torch.full((4,), value)
    ckpt.save(dirpath, name, strategy, {"value": value}, [Piece("model/w", (4,), torch.float32, 0, 4, data)], {})


@pytest.mark.parametrize("scenario", ["new-name", "same-name", "same-name-without-exchange"])
def test_a_crash_at_any_point_of_the_commit_leaves_latest_on_a_complete_checkpoint(tmp_path, monkeypatch, scenario):
    """The commit is killed at each of its file-system operations in turn (writes, fsyncs, renames, the exchange, the
    pointer): ``latest`` then always names a complete, verified checkpoint, the old one or the new one, and the error
    of a dangling pointer (impossible here) would list every complete checkpoint on disk."""
    import pathlib

    name = "ckpt-b" if scenario == "new-name" else "ckpt-a"
    if scenario.endswith("without-exchange"):
        monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    originals = [(ckpt, f, getattr(ckpt, f)) for f in ("_fsync_write", "_fsync_dir", "_exchange")]
    originals += [(pathlib.Path, "rename", pathlib.Path.rename), (ckpt.os, "replace", ckpt.os.replace),
                  (ckpt.shutil, "rmtree", ckpt.shutil.rmtree)]
    counted = {"n": 0, "crash_at": None}

    def point(fn):
        def wrapped(*args, **kwargs):
            counted["n"] += 1
            if counted["n"] == counted["crash_at"]:
                raise _Crash
            return fn(*args, **kwargs)
        return wrapped

    def run(crash_at: int | None, root) -> int:
        _save_values(root, "ckpt-a", 1.0)
        counted["n"], counted["crash_at"] = 0, crash_at
        for owner, attr, fn in originals:
            setattr(owner, attr, point(fn))
        try:
            _save_values(root, name, 2.0)
        except _Crash:
            pass
        finally:
            for owner, attr, fn in originals:
                setattr(owner, attr, fn)
        return counted["n"]

    operations = run(None, tmp_path / "whole")
    assert operations >= 5
    seen = set()
    for crash_at in range(1, operations + 1):
        root = tmp_path / f"crash{crash_at}"
        run(crash_at, root)
        found = ckpt.latest(root)  # never raises: the pointer names a complete checkpoint
        reader = ckpt.CheckpointReader(found)
        value = float(reader.full("model/w")[0])
        assert value in (1.0, 2.0) and reader.meta["value"] == value
        seen.add(value)
    assert seen == {1.0, 2.0}  # crashes before the switch keep the old one, after it the new one


def test_a_dangling_pointer_lists_every_complete_checkpoint(tmp_path):
    _save_values(tmp_path, "ckpt-a", 1.0)
    _save_values(tmp_path, "ckpt-b", 2.0)
    (tmp_path / "latest").write_text("ckpt-gone")
    (tmp_path / "ckpt-b").rename(tmp_path / ".old-ckpt-b")
    with pytest.raises(ckpt.CheckpointError, match="points at 'ckpt-gone'") as err:
        ckpt.latest(tmp_path)
    assert "ckpt-a" in str(err.value) and ".old-ckpt-b" in str(err.value)
