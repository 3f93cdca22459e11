"""Tensor-parallel plans for Hugging Face models: the model's own plan turned into trainkit's (with the entries
sequence parallelism needs), and the errors a plan that cannot work gets at setup, naming the entry to change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.cli_runs import ROOT
from trainkit_strategies.communication.plan_comm import PlanComm
from trainkit_strategies.tensor.huggingface import plan_of
from trainkit_strategies.tensor.plan import Embedding, GatherSequence, SplitSequence, apply_plan

SMALL = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _llama(**extra):
    from trainkit.hf import CausalLM

    torch.manual_seed(0)
    module = CausalLM(config=dict(model_type="llama", **SMALL, **extra))
    module.configure_model()
    return module


def test_the_models_own_plan_becomes_trainkits_with_the_sequence_parallel_entries():
    plan = plan_of(_llama())
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.lm_head"] == "lm_head"  # Hugging Face's colwise_gather_output: logits split by vocabulary
    assert plan["model.model.layers.0"] == SplitSequence()  # positions and the mask are made from the whole sequence
    assert plan["model.model.layers.*.self_attn"] == plan["model.model.layers.*.mlp"] == GatherSequence()
    assert "model.model.embed_tokens" not in plan  # replicated, as the model's plan leaves it
    assert plan_of(_llama(tie_word_embeddings=True))["model.model.embed_tokens"] == Embedding(whole_output=True)
    assert plan_of(torch.nn.Linear(2, 2)) is None


def test_a_style_trainkit_does_not_run_is_an_error_naming_the_entry():
    module = _llama()
    module.model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match=r"gives 'model.model.layers.\*.mlp.gate_up_proj' the style 'packed_colwise'"):
        plan_of(module)


def test_a_user_plan_without_gather_sequence_names_the_entry_under_sequence_parallelism():
    module = _llama()
    plan = {k: v for k, v in plan_of(module).items() if isinstance(v, str)}  # the projections only
    with pytest.raises(ValueError, match=r'add "model.model.layers.\*.self_attn": "gather_sequence"'):
        apply_plan(module, plan, PlanComm(2), sequence_parallel=True)
    apply_plan(_llama(), plan, PlanComm(2), sequence_parallel=False)  # without it the input is whole: nothing needed


def test_a_tied_embedding_left_out_of_the_plan_is_named():
    module = _llama(tie_word_embeddings=True)
    plan = {k: v for k, v in plan_of(module).items() if "embed_tokens" not in k}
    with pytest.raises(ValueError, match=r"model.model.embed_tokens.weight is shared with a layer .* 'embedding'"):
        apply_plan(module, plan, PlanComm(2), sequence_parallel=True)


def test_transformers_stays_optional(monkeypatch):
    """No library module imports transformers when it is imported (only trainkit.hf's functions do, when called),
    and CausalLM without it says what to install."""
    import ast

    for package in ("trainkit", "trainkit_strategies"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in tree.body:  # module level only
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] == "transformers" for n in names), path
    from trainkit.hf import CausalLM

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"trainkit\.hf needs Hugging Face transformers: pip install transformers"):
        CausalLM(config={"model_type": "llama"})


def test_a_tp_the_heads_cannot_share_is_refused_at_setup_naming_the_count():
    """2 key/value heads over 4 tensor-parallel ranks would split a head (a shape error inside attention): refused
    before any weight is cut, naming the count and the fix."""
    from trainkit_strategies import Environment, Precision, get_strategy

    module = _llama()
    strategy = get_strategy("parallel", tp=4)
    strategy.setup_environment(Environment(rank=0, world_size=4), comm=PlanComm(4))
    with pytest.raises(ValueError, match=r"tp=4: model has 2 key/value heads .* choose a tp that divides 2"):
        strategy.setup(module, torch.optim.AdamW(module.parameters()), Precision.from_name("32"))
    assert module.model.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)  # nothing was cut


WITHOUT = """
import importlib, pkgutil, sys
assert importlib.util.find_spec("transformers") is None
import torch, trainkit, trainkit_strategies
for package in (trainkit, trainkit_strategies):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
from trainkit import Trainer
from trainkit.demo.gpt import DemoGPT
from trainkit.demo.markov import MarkovData
from trainkit.estimate import estimate, one_batch
torch.manual_seed(0)
batch = one_batch(DemoGPT(n_layer=2), MarkovData())
with torch.device("meta"):
    plan = estimate(DemoGPT(n_layer=2), batch, world_size=2)
assert all(row.applies for row in plan.rows), plan.table()
trainer = Trainer(max_steps=2, enable_progress_bar=False, logger=False, enable_checkpointing=False)
trainer.fit(DemoGPT(n_layer=2), datamodule=MarkovData())
print("steps", trainer.global_step)
"""


@pytest.mark.slow
def test_without_transformers_everything_else_imports_and_runs(tmp_path):
    """With transformers unimportable: every module of both packages imports, ``estimate`` plans the demo GPT (the
    Hugging Face checks find no model) and it trains."""
    import site

    packages = tmp_path / "site-packages"  # this environment's packages but transformers (and its metadata)
    packages.mkdir()
    for where in site.getsitepackages():
        for entry in Path(where).iterdir():
            if not entry.name.lower().startswith("transformers") and not (packages / entry.name).exists():
                (packages / entry.name).symlink_to(entry)
    proc = subprocess.run([sys.executable, "-S", "-c", WITHOUT], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{packages}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 2" in proc.stdout
