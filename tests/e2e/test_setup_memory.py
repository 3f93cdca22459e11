"""Each rank builds and loads only its part: the peak host bytes of setup, per rank, for a Llama-shaped
``trainkit.hf.CausalLM`` of 202M parameters (float32, 808 MB), under ddp, zero2 and fsdp on 2 ranks, built from a
config, loaded from a ``save_pretrained`` directory, and resumed from a universal checkpoint (built from another seed,
then loaded); and its parameters equal a one-process build bit for bit. ``trainkit export`` of that checkpoint holds at
most one tensor.

The peak is the kernel's (VmHWM of /proc/self/status, reset by writing 5 to /proc/self/clear_refs after imports,
transformers' lazy ones included),
above the process's resident bytes at that moment (after a ``gc.collect()``, so the previous build is gone); glibc
returns every allocation above 64 KiB to the system when freed (MALLOC_MMAP_THRESHOLD_), so neither its caching nor
a freed temporary hides or inflates the figure. The bound is the issue's: the rank's share of parameters and
buffers, plus its largest single tensor, plus 10%, with no allowance: ddp allocates its gradient buckets at the
first backward, and pretrained tensors are read without mapping the file (its pages would stay resident).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 15, "num_attention_heads": 16, "num_key_value_heads": 4,
          "max_position_embeddings": 256, "tie_word_embeddings": True}

RANK = r'''
import json, os, sys
import torch
torch.set_num_threads(1)
from tests.e2e.test_setup_memory import digests, peak_above, reset_peak
from trainkit import checkpoint, transforms
from trainkit.hf import CausalLM
from trainkit_strategies import Environment, Precision, get_strategy

name, config, pretrained, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
warm = CausalLM(config={**config, "num_hidden_layers": 1, "vocab_size": 64})  # transformers' lazy imports: part of
with torch.device("meta"):  # the empty process, not of the model
    warm.configure_model()
saved = os.path.join(os.path.dirname(out), "checkpoints")
report = {}
for source in ("config", "pretrained", "resume"):
    torch.manual_seed(0 if source != "resume" else 1)  # resumed: other values first, the checkpoint's after loading
    start = reset_peak()
    strategy = get_strategy(name)
    strategy.setup_environment(Environment.from_env("cpu"))
    module = CausalLM(pretrained=pretrained) if source == "pretrained" else CausalLM(config=config)
    transforms.build(module, strategy)
    strategy.setup(module, torch.optim.AdamW(module.parameters()), Precision.from_name("32"))
    if source == "resume":
        strategy.load_state(checkpoint.CheckpointReader(os.path.join(saved, "saved")), None)
    peak = peak_above(start)
    if source == "config":
        checkpoint.save(saved, "saved", strategy, {}, strategy.state_pieces(), {})
    whole = strategy.full_parameters()
    report[source] = {"peak": peak, "rng": torch.get_rng_state().sum().item(),
                      "digests": digests(whole) if strategy.rank == 0 else {}}
    strategy.teardown()
    del whole, module, strategy
if int(os.environ["RANK"]) == 0:  # trainkit export of the checkpoint, piece by piece
    from safetensors.torch import load_file
    from trainkit.export import export
    start = reset_peak()
    exported = export(os.path.join(saved, "saved"), os.path.join(saved, "exported"))[0]
    report["export"] = {"peak": peak_above(start), "digests": digests(load_file(exported))}
    with open(out, "w") as f:
        json.dump(report, f)
'''


def reset_peak() -> int:
    """Reset the kernel's peak resident size to now; returns the resident bytes now."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def peak_above(start: int) -> int:
    return _status("VmHWM") - start


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
            for n, t in tensors.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A one-process build (transformers' ``from_config`` under seed 0), its digests, and its save_pretrained
    directory."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG))
    rng = torch.get_rng_state().sum().item()
    directory = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(directory)
    tensors = {"model." + n: p for n, p in model.named_parameters()}
    sizes = [t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"digests": digests(tensors), "directory": str(directory), "rng": rng,
            "params": sum(sizes) - buffers, "buffers": buffers, "largest": max(sizes)}


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp"])
def test_each_rank_builds_and_loads_only_its_part(tmp_path, reference, name):
    from tests.parity.harness import free_port

    assert reference["params"] >= 200e6 * 4
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, name, json.dumps(CONFIG), reference["directory"],
                               str(out)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in ranks]
    assert all(p.returncode == 0 for p in ranks), logs
    report = json.loads(out.read_text())
    params = reference["params"]
    # zero2 keeps whole parameters, and sets up its fp32 master pieces and gradient partition (half of each here)
    share = {"ddp": params, "zero2": 2 * params, "fsdp": params / 2}[name] + reference["buffers"]
    bound = (share + reference["largest"]) * 1.1
    for source in ("config", "pretrained", "resume"):
        got = report[source]
        print(f"{name} {source}: peak {got['peak'] / 2**20:.0f} MiB above the empty process, "
              f"bound {bound / 2**20:.0f} MiB")
        assert got["peak"] <= bound, (source, got["peak"] / 2**20, bound / 2**20)
        assert got["digests"] == reference["digests"], source  # bit for bit: from the seed, the files, a checkpoint
    exported = report["export"]  # it holds one stored piece (at most a tensor) at a time
    print(f"{name} export: peak {exported['peak'] / 2**20:.0f} MiB, largest {reference['largest'] / 2**20:.0f} MiB")
    assert exported["peak"] <= 1.1 * reference["largest"], exported["peak"] / 2**20
    assert exported["digests"] == reference["digests"]
    assert report["config"]["rng"] == reference["rng"]  # later draws (dropout, shuffling) as in one process
