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


def test_truncation_is_detected_and_names_the_file(tmp_path):
    _train(tmp_path, 10)
    path = tmp_path / "checkpoints" / "epoch=0-step=10"
    size = _rank_file(path).stat().st_size
    with open(_rank_file(path), "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ckpt.CheckpointError, match=rf"{size - 100} bytes, expected {size}") as err:
        _train(tmp_path, 20, ckpt_path=str(path))
    assert str(_rank_file(path)) in str(err.value)


def test_altered_meta_json_is_detected(tmp_path):
    _train(tmp_path, 10)
    meta_path = tmp_path / "checkpoints" / "epoch=0-step=10" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["loop"]["global_step"] = 3
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"meta\.json is corrupt"):
        _train(tmp_path, 20, ckpt_path="last")


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
    with pytest.raises(OSError, match="simulated"):
        _train(tmp_path, 20, ckpt_path="last")
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
