"""Hugging Face MoE blocks under expert parallelism: a ``trainkit.hf.CausalLM`` of each family whose experts
transformers holds packed (Mixtral; Qwen2-MoE with its shared expert; Qwen3-MoE; OLMoE; DeepSeek-V3 with its grouped
routing and correction bias) computes at ep=2 the logits and gradients one process computes on the same tokens,
with each rank holding its half of every layer's experts; its checkpoints resume at one process and back; a family
whose experts are held otherwise (GPT-OSS: transposed, biased, a clamped gate) is refused by name at setup. Ranks are
threads of this process computing with real values (``tests/simworld.py``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.simworld import CPU, SimWorld
from tests.unit import test_parallel_resume as parallel_resume
from trainkit_strategies import Environment, get_strategy
from trainkit_strategies.errors import ConfigurationError

pytest.importorskip("transformers")

SMALL = dict(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32)
FAMILIES = {  # tiny configs with 4 routed experts, top 2
    "mixtral": dict(model_type="mixtral", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),
    "qwen2_moe": dict(model_type="qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      head_dim=8, norm_topk_prob=True),
    "olmoe": dict(model_type="olmoe", intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        num_key_value_heads=4, rope_scaling=None),
}


def causal_lm(family: str) -> torch.nn.Module:
    from trainkit.hf import CausalLM

    torch.manual_seed(0)
    module = CausalLM(config={**SMALL, **FAMILIES[family]}, warmup_steps=1, max_steps=10, adam_eps=1e-3)
    module.configure_model()
    with torch.no_grad():  # routers that prefer some experts: every rank sends rows to the other
        for name, p in module.named_parameters():
            if name.endswith(("gate.weight", "e_score_correction_bias")):
                p.normal_(0.0, 1.0)
    return module


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(rank))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_rank_computes_what_one_process_computes_on_its_tokens(family):
    whole = causal_lm(family)
    packed = [m for m in whole.modules() if type(m).__name__.endswith("Experts")]
    assert packed  # the family's MoE blocks have transformers' packed experts
    world = SimWorld(2, device=CPU)

    def rank(r: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
        module = copy.deepcopy(whole)
        strategy = get_strategy("parallel", ep=2)
        strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
        strategy.parallelize(module)
        logits = module(_tokens(r))
        logits.square().mean().backward()
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        return logits.detach(), grads, {n: tuple(p.shape) for n, p in module.named_parameters()}

    wants = []
    for r in range(2):
        whole.zero_grad()
        logits = whole(_tokens(r))
        logits.square().mean().backward()
        wants.append((logits.detach(), {n: p.grad.clone() for n, p in whole.named_parameters()}))
    for r, (logits, grads, shapes) in enumerate(world.run(rank)):
        torch.testing.assert_close(logits, wants[r][0], rtol=1e-5, atol=1e-6)
        for name, p in whole.named_parameters():
            expected = wants[r][1][name]  # a replicated parameter: this rank's tokens' gradient
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # this rank's block of 2 experts, with
                assert shapes[name] == (2, *p.shape[1:]), name  # every rank's tokens routed to them
                expected = (wants[0][1][name] + wants[1][1][name])[2 * r:2 * r + 2]
            torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_family_whose_experts_are_held_otherwise_is_refused_by_name():
    from trainkit.hf import CausalLM

    module = CausalLM(config={**SMALL, "model_type": "gpt_oss", "intermediate_size": 32, "num_local_experts": 4,
                              "num_experts_per_tok": 2, "head_dim": 8, "layer_types": ["full_attention"] * 2},
                      attn_implementation="eager")
    with torch.device("meta"):
        module.configure_model()
    world = SimWorld(2, device=CPU)

    def rank(r: int) -> str:
        strategy = get_strategy("parallel", ep=2)
        strategy.setup_environment(Environment(rank=r, world_size=2), comm=world.comm(r))
        with pytest.raises(ConfigurationError) as refused:
            strategy.parallelize(module if r == 0 else copy.deepcopy(module))
        return str(refused.value)

    message = world.run(rank)[0]
    assert "gpt_oss" in message and "GptOssExperts" in message and "ep=1" in message, message
    assert all(p.shape[0] == 4 for n, p in module.named_parameters() if "experts" in n)  # nothing was cut


LAYOUTS = {"single": ("single", {}, 1), "ep2@2": ("parallel", {"ep": 2}, 2)}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 16, (8, 9), generator=gen) for _ in range(2)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run(layout: str, steps: list[int], load: Path | None, save: Path | None) -> dict[str, torch.Tensor]:
    return parallel_resume.run(layout, steps, load, save, LAYOUTS, lambda: causal_lm("mixtral"), batches)


@pytest.mark.parametrize("pair", [("ep2@2", "single"), ("single", "ep2@2")], ids=lambda p: "-to-".join(p))
def test_a_checkpoint_resumes_across_ep(tmp_path, pair):
    """One step saved under one layout and one under the other: the second step equals two steps of one process."""
    saved, resumed = pair
    run(saved, [0], None, tmp_path / saved)
    got, want = run(resumed, [1], tmp_path / saved, None), run("single", [0, 1], None, None)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
