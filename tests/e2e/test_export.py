"""``trainkit export``: a sharded checkpoint of a few hundred MB streamed to safetensors with peak memory far
below the model's size, loaded back bit for bit; shards with a Hugging Face index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.e2e.cli_runs import ROOT
from tests.helpers import accelerator_for
from trainkit.checkpoint import CheckpointReader, latest

WIDTH, LAYERS = 4096, 4  # 4 x (4096 x 4096 + 4096) fp32 parameters: 268 MB

TRAIN_SCRIPT = f'''
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import trainkit as tk


class Wide(tk.TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear({WIDTH}, {WIDTH}) for _ in range({LAYERS})])

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(4, {WIDTH}))
    trainer = tk.Trainer(devices=2, accelerator="{accelerator_for(2)}", strategy="zero2", max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1],
                         timeout_s=300)
    trainer.fit(Wide(), DataLoader(data, batch_size=2))
'''

MEASURE = '''
import resource, sys
import torch, safetensors
from trainkit.export import export
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
export(sys.argv[1], sys.argv[2])
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
'''


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint written by zero2 at 2 ranks: every parameter's fp32 master split between two files."""
    root = tmp_path_factory.mktemp("wide")
    script = root / "train.py"
    script.write_text(TRAIN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=600,
                          env=_env(), cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    path = latest(root / "checkpoints")
    assert path is not None and len(CheckpointReader(path).meta["files"]) == 2
    return path


def test_export_streams_with_peak_memory_below_half_the_model(sharded_checkpoint, tmp_path):
    model_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(sharded_checkpoint), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    base_kb, peak_kb = map(int, proc.stdout.split())
    growth = (peak_kb - base_kb) * 1024
    print(f"model {model_bytes / 2**20:.0f} MiB, export peak RSS growth {growth / 2**20:.1f} MiB")
    assert growth < model_bytes / 2
    reader = CheckpointReader(sharded_checkpoint)
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(exported) == sorted(k.removeprefix("model/") for k in reader.keys() if k.startswith("model/"))
    for name, tensor in exported.items():
        assert torch.equal(tensor, reader.full(f"model/{name}")), name
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    module.load_state_dict({k.removeprefix("layers."): v for k, v in exported.items()})  # the user's module
    assert torch.equal(module[0].weight, reader.full("model/layers.0.weight"))


def test_export_cli_writes_shards_with_a_hugging_face_index(sharded_checkpoint, tmp_path):
    out = tmp_path / "shards"
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "export", str(sharded_checkpoint.parent), str(out),
                           "--max_shard_size", "50MB", "--dtype", "bf16"], capture_output=True, text=True,
                          timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]  # one 33.5 MB bf16 matrix each
    reader = CheckpointReader(sharded_checkpoint)
    total = 0
    for file in files:
        assert (out / file).stat().st_size <= 50_000_000 + 4096  # payload within the limit, plus the header
        with safe_open(str(out / file), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
                assert tensor.dtype == torch.bfloat16
                assert torch.equal(tensor, reader.full(f"model/{name}").to(torch.bfloat16)), name
    assert index["metadata"]["total_size"] == total
