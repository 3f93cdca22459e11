"""Each rank builds and loads only its part: the peak host bytes of setup, per rank, for a Llama-shaped
``trainkit.hf.CausalLM`` of 202M parameters (float32, 808 MB), under ddp, zero2, fsdp, tp2 and pp2 on 2 ranks and
tp2 x dp_shard2 on 4, and for a Mixtral-shaped one of 224M (8 experts of top 2 in 3 layers, 151M of them experts)
under ep2, built from a config and loaded from a ``save_pretrained`` directory (zero2, beyond the issue's
layouts, from the config only); and its parameters equal a
one-process build bit for bit; so are ddp, fsdp and tp2 resumed from a universal checkpoint (built from another seed,
then loaded), and ``trainkit export`` of that checkpoint holds at most one tensor. The layouts of one world run one
after another in one process group.

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
MOE_CONFIG = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048,
              "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 4, "num_local_experts": 8,
              "num_experts_per_tok": 2, "max_position_embeddings": 256, "sliding_window": None}
MODEL_OF = {"ep2": "moe"}  # the layouts that build the MoE model (the others: the Llama)

RANK = r'''
import json, os, sys
import torch
torch.set_num_threads(1)
from tests.e2e.test_setup_memory import MODEL_OF, RESUMED, digests, held, peak_above, reset_peak, sources
from trainkit import checkpoint, transforms
from trainkit.hf import CausalLM
from trainkit_strategies import Environment, Precision, get_strategy

layouts, configs, directories = (json.loads(a) for a in sys.argv[1:4])
out = sys.argv[4]
for model in {MODEL_OF.get(label, "llama") for label in layouts}:  # transformers' lazy imports: part of the empty
    warm = CausalLM(config={**configs[model], "num_hidden_layers": 1, "vocab_size": 64})  # process, not of the model
    with torch.device("meta"):
        warm.configure_model()
saved = os.path.join(os.path.dirname(out), "checkpoints")
report = {}
for label, (name, options) in layouts.items():
    config, pretrained = configs[MODEL_OF.get(label, "llama")], directories[MODEL_OF.get(label, "llama")]
    for source in sources(label):
        torch.manual_seed(0 if source != "resume" else 1)  # resumed: other values first, the checkpoint's after loading
        start = reset_peak()
        strategy = get_strategy(name, **options)
        strategy.setup_environment(Environment.from_env("cpu"))
        module = CausalLM(pretrained=pretrained) if source == "pretrained" else CausalLM(config=config)
        transforms.build(module, strategy)
        strategy.setup(module, torch.optim.AdamW(module.parameters()), Precision.from_name("32"))
        if source == "resume":
            strategy.load_state(checkpoint.CheckpointReader(os.path.join(saved, label)), None)
        peak, kept = peak_above(start), held(module)
        if source == "config" and label in RESUMED:
            checkpoint.save(saved, label, strategy, {}, strategy.state_pieces(), {})
        whole = strategy.full_parameters()
        report[f"{label} {source}"] = {"peak": peak, "held": kept, "rng": torch.get_rng_state().sum().item(),
                                       "digests": digests(whole) if strategy.rank == 0 else {}}
        strategy.teardown()
        del whole, module, strategy
if int(os.environ["RANK"]) == 0 and RESUMED[0] in layouts:  # trainkit export of a checkpoint, piece by piece
    from safetensors.torch import load_file
    from trainkit.export import export
    start = reset_peak()
    exported = export(os.path.join(saved, RESUMED[0]), os.path.join(saved, "exported"))[0]
    report["export"] = {"peak": peak_above(start), "digests": digests(load_file(exported))}
with open(out + os.environ["RANK"], "w") as f:
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


def held(module: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers ``module`` holds after setup, each storage once (a rank's share)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (*module.parameters(),
                *module.buffers()) if t.device.type != "meta"}
    return sum(storages.values())


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
            for n, t in tensors.items()}


def _built(config: dict, directory: Path) -> dict:
    """A one-process build (transformers' ``from_config`` under seed 0), its digests, and its save_pretrained
    directory."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    rng = torch.get_rng_state().sum().item()
    model.save_pretrained(directory)
    tensors = {"model." + n: p for n, p in model.named_parameters()}
    sizes = [t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"digests": digests(tensors), "directory": str(directory), "rng": rng,
            "params": sum(sizes) - buffers, "buffers": buffers, "largest": max(sizes),
            "vectors": sum(q.numel() * q.element_size() for q in model.parameters() if q.dim() == 1),
            "experts": sum(q.numel() * q.element_size() for n, q in model.named_parameters() if ".experts." in n)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _built(CONFIG, tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return _built(MOE_CONFIG, tmp_path_factory.mktemp("pretrained_moe"))


RESUMED = ("ddp", "fsdp", "tp2")  # saved after their build from the config, resumed from it (export: the first's)
CONFIG_ONLY = ("zero2",)  # beyond the layouts: built from the config only (the suite's time)


def sources(label: str) -> tuple[str, ...]:
    """Where ``label``'s builds take their values from: the config (seed 0), the save_pretrained files, a checkpoint."""
    if label in CONFIG_ONLY:
        return ("config",)
    return ("config", "pretrained", "resume") if label in RESUMED else ("config", "pretrained")
WORLDS = {2: {"ddp": ("ddp", {}), "zero2": ("zero2", {}), "fsdp": ("fsdp", {}), "tp2": ("parallel", {"tp": 2}),
             "pp2": ("parallel", {"pp": 2}), "ep2": ("parallel", {"ep": 2})},
          4: {"tp2 x dp_shard2": ("parallel", {"tp": 2, "dp_shard": 2})}}


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_each_rank_builds_and_loads_only_its_part(tmp_path, request, reference, world):
    from tests.parity.harness import free_port

    references = {"llama": reference}
    if any(label in MODEL_OF for label in WORLDS[world]):
        references["moe"] = request.getfixturevalue("moe_reference")
    assert all(r["params"] >= 200e6 * 4 for r in references.values())
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    configs, directories = {"llama": CONFIG, "moe": MOE_CONFIG}, {k: r["directory"] for k, r in references.items()}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, json.dumps(WORLDS[world]), json.dumps(configs),
                               json.dumps(directories), str(out)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=200 * len(WORLDS[world]))[0] for p in ranks]
    assert all(p.returncode == 0 for p in ranks), logs
    reports = [json.loads(Path(f"{out}{r}").read_text()) for r in range(world)]
    for label in WORLDS[world]:
        built = references[MODEL_OF.get(label, "llama")]
        params, buffers = built["params"], built["buffers"]
        # what each rank keeps, from the model's shapes: ddp whole; zero2 whole plus its fp32 master pieces and
        # gradient partition (half of each); fsdp half; tp2 the matrices halved (every one is split), vectors whole;
        # ep2 everything but the experts whole, half the experts; a pipeline stage what it holds (its layers, the tied
        # embedding on both stages)
        split = {"ddp": params, "zero2": 2 * params, "fsdp": params / 2, "tp2": (params + built["vectors"]) / 2,
                 "tp2 x dp_shard2": (params + built["vectors"]) / 4, "ep2": params - built["experts"] / 2}
        for source in sources(label):
            for rank, report in enumerate(reports):
                got = report[f"{label} {source}"]
                share = split.get(label, got["held"] - buffers) + buffers
                bound = (share + built["largest"]) * 1.1
                print(f"{label} {source} rank {rank}: peak {got['peak'] / 2**20:.0f} MiB above the empty process, "
                      f"bound {bound / 2**20:.0f} MiB, held {got['held'] / 2**20:.0f} MiB")
                assert got["peak"] <= bound, (label, source, rank, got["peak"] / 2**20, bound / 2**20)
                if label == "pp2":  # a stage holds part of the model: its layers, not the others'
                    assert got["held"] < 0.75 * (params + buffers), (rank, got["held"])
                if label == "ep2":  # this rank's half of the experts, not the other's
                    assert got["held"] == params - built["experts"] / 2 + buffers, (rank, got["held"])
            got = reports[0][f"{label} {source}"]
            assert got["digests"] == built["digests"], (label, source)  # from the seed, files, a checkpoint
        assert reports[0][f"{label} config"]["rng"] == built["rng"]  # later draws as in one process
    if "export" in reports[0]:  # it holds one stored piece (at most a tensor) at a time
        exported = reports[0]["export"]
        print(f"export: peak {exported['peak'] / 2**20:.0f} MiB, largest {reference['largest'] / 2**20:.0f} MiB")
        assert exported["peak"] <= 1.1 * reference["largest"], exported["peak"] / 2**20
        assert exported["digests"] == reference["digests"]
