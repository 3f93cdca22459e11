"""``trainkit fit --model trainkit.hf.CausalLM``: a transformers Llama built from a config on the command line, trained
under ddp, fsdp and tensor parallelism (its own plan), logging train_loss to TensorBoard."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.e2e.cli_runs import ROOT, scalars
from tests.helpers import accelerator_for

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

CONFIG = {"model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _fit(tmp_path, name: str, strategy: list[str]) -> dict[int, float]:
    root = tmp_path / name
    root.mkdir()
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--model", "trainkit.hf.CausalLM", "--model.config",
           json.dumps(CONFIG), "--model.max_steps", "4", "--model.warmup_steps", "1",
           "--model.adam_eps", "1e-3", "--trainer.devices", "2",
           "--trainer.accelerator", accelerator_for(2), *strategy, "--trainer.max_steps", "4",
           "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false", "--trainer.timeout_s", "120",
           "--trainer.seed", "0",  # every rank builds the same initial weights (fsdp shards each rank's own)
           "--trainer.default_root_dir", str(root), "--data", "trainkit.demo.markov.MarkovData",
           "--data.train_sequences", "64", "--data.val_sequences", "8"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return scalars(root, "train_loss")


def test_a_hugging_face_model_trains_from_the_cli_under_ddp_fsdp_and_tp(tmp_path):
    ddp = _fit(tmp_path, "ddp", ["--trainer.strategy", "ddp"])
    fsdp = _fit(tmp_path, "fsdp", ["--trainer.strategy", "fsdp"])
    tp = _fit(tmp_path, "tp", ["--trainer.strategy", "parallel", "--trainer.strategy.tp", "2"])
    assert len(ddp) == 4 and ddp.keys() == fsdp.keys() == tp.keys()
    # the same global batches under ddp and fsdp: the same losses (Adam's eps at 1e-3, as in the parity suite, so
    # reduction-order noise in a near-zero gradient element is not turned into a different update)
    for step, loss in ddp.items():
        assert math.isfinite(loss) and abs(fsdp[step] - loss) <= 1e-5 * max(1.0, loss), (step, fsdp[step], loss)
    assert all(math.isfinite(v) for v in tp.values())
    assert math.log(16) - 0.5 < ddp[min(ddp)] < math.log(16) + 0.5  # starts near chance over 16 tokens


def test_a_hugging_face_models_logged_loss_under_context_parallelism_is_one_processs(tmp_path):
    """Under cp=2 each rank's loss covers its two chunks of every sequence; TensorBoard's train_loss is the whole
    sequences', equal to one process's within 1e-5 (the same global batches: cp ranks read the same samples)."""
    single = _fit(tmp_path, "single", ["--trainer.strategy", "single", "--trainer.devices", "1"])
    cp = _fit(tmp_path, "cp", ["--trainer.strategy", "parallel", "--trainer.strategy.cp", "2"])
    assert len(single) == 4 and single.keys() == cp.keys()
    for step, loss in single.items():
        assert abs(cp[step] - loss) <= 1e-5 * max(1.0, loss), (step, cp[step], loss)


def _text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(" ".join(["the cat sat on the mat and the dog sat on the log"] * 40))
    return path


def test_a_hugging_face_model_trains_on_a_text_file_as_bytes_from_the_cli(tmp_path):
    config = {**CONFIG, "vocab_size": 256}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "trainkit.cli", "fit", "--model", "trainkit.hf.CausalLM", "--model.config",
           json.dumps(config), "--data", "trainkit.hf.TextData", "--data.path", str(_text(tmp_path)),
           "--data.block_size", "16", "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = scalars(tmp_path, "train_loss")
    assert len(losses) == 3 and math.log(256) - 1.0 < losses[min(losses)] < math.log(256) + 1.0


def test_text_data_reads_through_a_tokenizer_the_user_names(tmp_path):
    """A tokenizer saved in a local directory (a word-level one made here, offline) turns the text into its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trainkit.hf import TextData

    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "and", "dog", "log"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(str(tmp_path / "tok"))
    data = TextData(str(_text(tmp_path)), tokenizer=str(tmp_path / "tok"), block_size=8, batch_size=2)
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (2, 8) and int(x.max()) < len(words)
    assert data.tokens()[:4].tolist() == [1, 2, 3, 4]  # the cat sat on


def test_trainkit_estimate_plans_a_hugging_face_model(tmp_path):
    """``trainkit estimate`` on a CausalLM: every strategy and the layouts of its own plan (tp, tp x pp) planned
    with activations and bytes per step; the tp its key/value heads cannot share is a row saying why."""
    cmd = [sys.executable, "-m", "trainkit.cli", "estimate", "--model", "trainkit.hf.CausalLM", "--model.config",
           json.dumps(CONFIG), "--data", "trainkit.demo.markov.MarkovData", "--trainer.devices", "4"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line[:14].strip(): line for line in proc.stdout.splitlines()[2:]}  # the label column
    for name in ("ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline", "tp2 dp2", "pp2 tp2"):
        assert name in rows and "n/a" not in rows[name] and "?" not in rows[name], proc.stdout
    assert "n/a: model has 2 key/value heads" in rows["tp4"], proc.stdout
