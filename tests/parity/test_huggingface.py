"""Hugging Face models (``trainkit.hf.CausalLM`` around ``transformers``' Llama, Mistral and Qwen2, built from small
configs offline) under strategy="parallel" against one process on the same global batches, fp32 within 1e-5, with
accumulation and clipping, with no plan written: the models' own tensor-parallel plans, plus the entries sequence
parallelism needs (the sequence gathered at attention's and the MLP's input, split at the first decoder layer); under
context parallelism their attention runs trainkit's ring through transformers' AttentionInterface, with the rank's
real positions. Mixtral and Qwen2-MoE (its shared expert replicated) at ep=2: each rank builds half of every layer's
packed experts on the meta device, and tokens reach them through trainkit's all-to-all dispatcher."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

MODELS = ("hf_llama", "hf_mistral", "hf_qwen2", "hf_gpt2")
MOE_MODELS = ("hf_mixtral", "hf_qwen2_moe")  # ep=2: their packed experts divided, reached by all-to-all


def _cases(world: int) -> list[Case]:
    layouts = {2: {"tp2": {"tp": 2}, "tp2-no-sp": {"tp": 2, "sequence_parallel": False}, "cp2": {"cp": 2},
                   "pp2": {"pp": 2}},
               4: {"tp2-dps2": {"tp": 2, "dp_shard": 2}, "cp2-tp2": {"cp": 2, "tp": 2}, "pp2-tp2": {"pp": 2, "tp": 2}}
               }[world]
    cases = [Case(f"{name}-{model}", "parallel", options, model=model, accumulate=2, clip=0.05)
             for name, options in layouts.items() for model in MODELS
             if not (model == "hf_gpt2" and "pp" in options)]  # GPT-2 has no pipeline stages (docs/huggingface.md)
    if world == 2:  # a head tied to the embedding: both split by vocabulary, the embedding's lookups summed whole
        cases.append(Case("tp2-hf_llama_tied", "parallel", {"tp": 2}, model="hf_llama_tied", accumulate=2, clip=0.05))
        cases += [Case(f"ep2-{model}", "parallel", {"ep": 2}, model=model, accumulate=2, clip=0.05)
                  for model in MOE_MODELS]
    if world == 4:  # each rank a quarter of the experts' state: half the experts, sharded over dp_shard
        cases.append(Case("ep2-dps2-hf_mixtral", "parallel", {"ep": 2, "dp_shard": 2}, model="hf_mixtral",
                          accumulate=2, clip=0.05))
    return cases


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_world(2, _cases(2))


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_world(4, _cases(4))


@pytest.mark.parametrize("case", _cases(2), ids=lambda c: c.name)
def test_two_ranks_match_single_process(two_ranks, case):
    assert_parity(two_ranks[case.name], run_reference(case, 2), case.tolerance())


@pytest.mark.parametrize("case", _cases(4), ids=lambda c: c.name)
def test_four_ranks_match_single_process(four_ranks, case):
    assert_parity(four_ranks[case.name], run_reference(case, 4), case.tolerance())
