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


@pytest.mark.slow
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


@pytest.mark.slow
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


HF_MODULE = '''
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
import trainkit as tk


class Wrapped(tk.TrainModule):
    """The most common module there is: a TrainModule around a Hugging Face model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                              bos_token_id=0, eos_token_id=0))

    def training_step(self, batch, batch_idx):
        return self.gpt(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    module = Wrapped()
    trainer = tk.Trainer(devices=int(sys.argv[2]), accelerator="cpu", strategy=sys.argv[3], max_steps=3,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=sys.argv[1])
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    if trainer.is_global_zero and sys.argv[3] == "single":
        module.gpt.eval()
        with torch.no_grad():
            torch.save(module.gpt(input_ids=tokens[:2]).logits, sys.argv[1] + "/logits.pt")
'''


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "strategy"), [(1, "single"), (2, "fsdp")])
def test_export_of_a_wrapped_hugging_face_model_loads_with_from_pretrained(tmp_path, devices, strategy):
    """``trainkit export --submodule gpt``: the wrapper's prefix is gone and the model's own config.json sits beside
    the weights (recorded in the checkpoint at save time), so ``from_pretrained`` loads the directory; its logits
    equal the trained module's (single) and a sharded run's export loads the same way (fsdp at 2 ranks)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed; pip install "
                                       "'trainkit[test]' installs it")
    script = tmp_path / "train_hf.py"
    script.write_text(HF_MODULE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(devices), strategy], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "export", str(tmp_path / "checkpoints"), str(out),
                           "--submodule", "gpt"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.startswith("gpt.")]
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert model.config.n_embd == 32 and model.config.n_layer == 2
    if strategy == "single":
        model.eval()
        tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(input_ids=tokens[:2]).logits
        torch.testing.assert_close(logits, torch.load(tmp_path / "logits.pt"), rtol=0, atol=1e-5)


def test_export_of_a_missing_submodule_names_the_ones_there(tmp_path):
    from tests.helpers import Regression, loader, quiet_trainer, regression_data
    from trainkit.callbacks import ModelCheckpoint
    from trainkit.checkpoint import CheckpointError
    from trainkit.export import export

    quiet_trainer(tmp_path, max_steps=2, callbacks=[ModelCheckpoint()]).fit(Regression(), loader(regression_data(8), 4))
    with pytest.raises(CheckpointError, match="no tensors of a submodule 'gpt'; its model's top-level submodules "
                                              "are: net"):
        export(tmp_path / "checkpoints", tmp_path / "out", submodule="gpt")


CAUSAL_LM = '''
import json
import sys
import torch
from torch.utils.data import DataLoader
import trainkit as tk
from trainkit.demo.markov import MarkovChain, TokenWindows
from trainkit.hf import CausalLM
from trainkit_strategies import get_strategy

CONFIG = dict(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

if __name__ == "__main__":
    root, devices, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    torch.manual_seed(0)
    module = CausalLM(config=CONFIG, warmup_steps=2, max_steps=4)
    data = TokenWindows(MarkovChain(16, 0.5, seed=3).sample(32, 17, seed=4))
    trainer = tk.Trainer(devices=devices, accelerator="cpu", strategy=get_strategy("parallel", **options),
                         max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, timeout_s=120)
    trainer.fit(module, DataLoader(data, batch_size=4))
    whole = trainer.strategy.full_parameters()  # every parameter whole, gathered from its parts
    if trainer.is_global_zero:
        trained = CausalLM(config=CONFIG)
        trained.configure_model()
        loaded = trained.load_state_dict({k: v.detach().cpu() for k, v in whole.items()}, strict=False)
        assert not set(loaded.missing_keys) & set(dict(trained.named_parameters())), loaded.missing_keys
        trained.eval()
        with torch.no_grad():
            torch.save(trained(data[0][0].unsqueeze(0)), root + "/logits.pt")
'''


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "options"), [(4, {"tp": 2, "dp_shard": 2}), (2, {"cp": 2}), (2, {"pp": 2}),
                                                 (4, {"dp_replicate": 2, "dp_shard": 2})],
                         ids=["tp2-dp_shard2", "cp2", "pp2", "hsdp2x2"])
def test_a_hugging_face_model_trained_on_a_mesh_exports_for_from_pretrained(tmp_path, devices, options):
    """trainkit.hf.CausalLM (a transformers Llama) trained under tp=2 x dp_shard=2, cp=2, pp=2 and HSDP (2 replicas
    of 2 shards), exported with
    ``--submodule model``: ``AutoModelForCausalLM.from_pretrained`` loads the directory as-is and gives the trained
    model's logits (its parameters gathered whole from the ranks' parts) within 1e-5."""
    import json

    import transformers

    script = tmp_path / "train_causal_lm.py"
    script.write_text(CAUSAL_LM)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(devices), json.dumps(options)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", "export", str(tmp_path / "checkpoints"), str(out),
                           "--submodule", "model"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32
    from trainkit.demo.markov import MarkovChain, TokenWindows

    x = TokenWindows(MarkovChain(16, 0.5, seed=3).sample(32, 17, seed=4))[0][0].unsqueeze(0)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    torch.testing.assert_close(logits, torch.load(tmp_path / "logits.pt"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("max_shard_size", [None, 16])
def test_export_replaces_a_planted_link_rather_than_writing_through_it(tmp_path, max_shard_size):
    """Every name export writes in ``out`` (the files, the index, config.json, and the temporary names it used to
    write first) is planted as a link to a file outside: each victim keeps its bytes and each name becomes a regular
    file holding the export."""
    from trainkit import checkpoint as ckpt
    from trainkit.export import export
    from trainkit_strategies import Environment, get_strategy
    from trainkit_strategies.state.pieces import Piece

    strategy = get_strategy("single")
    strategy.setup_environment(Environment())
    weights = {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}
    pieces = [Piece(f"model/{name}", (4,), torch.float32, 0, 4, t) for name, t in weights.items()]
    path = ckpt.save(tmp_path / "ckpt", "c", strategy, {"configs": {"": {"n": 1}}}, pieces, {})
    out = tmp_path / "out"
    out.mkdir()
    names = (["model.safetensors"] if max_shard_size is None else
             [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + ["model.safetensors.index.json"])
    names += ["config.json"]
    victims = {}
    for name in names + [f".{name}.tmp" for name in names]:
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious")
        (out / name).symlink_to(victim)
        victims[victim] = name
    written = export(path, out, max_shard_size=max_shard_size)
    assert sorted(p.name for p in written) == sorted(names)
    assert all(victim.read_text() == "precious" for victim in victims)
    assert all(not (out / name).is_symlink() and (out / name).is_file() for name in names)
    assert json.loads((out / "config.json").read_text()) == {"n": 1}
    exported = {k: v for p in written if p.suffix == ".safetensors" for k, v in load_file(str(p)).items()}
    assert all(torch.equal(exported[name], t) for name, t in weights.items())
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]  # none left over
