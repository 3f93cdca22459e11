"""strategy="parallel" against one process on the global batch, fp32 within 1e-5, with accumulation and clipping, on
the demo GPT (tied embedding and head, fused q/k/v, learned positions) and examples/llama.py (RMSNorm, rotary,
SwiGLU, grouped-query attention): tensor parallelism with and without sequence parallelism, with FSDP units inside
it, HSDP, pipelines of tensor-parallel stages, up to 8 ranks, and context parallelism (ring and all-gather attention)
alone, with FSDP units and with tensor parallelism; Ulysses attention at cp=2 and cp=4 (a GPT of 4 heads)."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

MODELS = ("gpt", "llama")


def _cases(world: int) -> list[Case]:
    layouts = {
        2: {"tp2": {"tp": 2}, "tp2-no-sp": {"tp": 2, "sequence_parallel": False}, "cp2": {"cp": 2},
            "cp2-all-gather": {"cp": 2, "cp_method": "all_gather"}},
        4: {"tp2-dps2": {"tp": 2, "dp_shard": 2}, "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
            "pp2-tp2": {"pp": 2, "tp": 2}, "cp4": {"cp": 4}, "cp2-dps2": {"cp": 2, "dp_shard": 2},
            "cp2-tp2": {"cp": 2, "tp": 2}},
        8: {"pp2-tp2-dps2": {"pp": 2, "tp": 2, "dp_shard": 2}},
    }[world]
    cases = [Case(f"{name}-{model}", "parallel", options, model=model, accumulate=2, clip=0.05)
             for name, options in layouts.items() for model in MODELS]
    engines = {  # the one-axis strategies as engines of the layout constructor
        2: {"dps2-zero2": {"data_parallel": "zero2"},
            "dps2-zero-offload": {"data_parallel": "zero_offload", "engine_options": {"ratio": 0.5}},
            "dps2-zero-offload-early": {"data_parallel": "zero_offload", "engine_options": {"overlap_step": True}},
            "dpr2-ddp-unused": {"dp_replicate": 2, "data_parallel": "ddp",
                                "engine_options": {"find_unused_parameters": True}}},
        4: {"hsdp2x2-zero3": {"dp_replicate": 2, "dp_shard": 2, "data_parallel": "zero3"}},
        8: {},
    }[world]
    cases += [Case(f"{name}-gpt", "parallel", options, model="gpt", accumulate=2,  # early: unclipped, unprobed, so
                   **({"clip": None, "probe_grads": False} if name.endswith("early") else {"clip": 0.05}))  # the host
              for name, options in engines.items()]  # step runs during backward
    if world == 2:  # evaluation: val_loss averaged over the data-parallel ranks only (tp ranks hold the same)
        cases.append(Case("tp2-validate-gpt", "parallel", {"tp": 2}, model="gpt", validate=True, per_rank_batch=8))
        cases += [Case(f"tp2-selective-checkpointing-{model}", "parallel", {"tp": 2}, model=model, accumulate=2,
                       clip=0.05, checkpointing="selective") for model in MODELS]  # the recompute re-gathers
        cases += [Case("cp2-selective-checkpointing-gpt", "parallel", {"cp": 2}, model="gpt", accumulate=2,
                       clip=0.05, checkpointing="selective"),  # the ring's output kept, never replayed
                  Case("cp2-full-checkpointing-llama", "parallel", {"cp": 2}, model="llama", accumulate=2,
                       clip=0.05, checkpointing="full")]  # the ring run again in backward
    ulysses = {2: [("cp2", "gpt"), ("cp2", "llama")], 4: [("cp4", "gpt_h4"), ("cp4", "llama")], 8: []}[world]
    cases += [Case(f"{name}-ulysses-{model}", "parallel", {"cp": world, "cp_method": "ulysses"}, model=model,
                   accumulate=2, clip=0.05) for name, model in ulysses]  # heads for sequence, by all-to-all
    return cases


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_world(2, _cases(2))


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_world(4, _cases(4))


@pytest.fixture(scope="module")
def eight_ranks() -> dict:
    return run_world(8, _cases(8))


@pytest.mark.parametrize("case", _cases(2), ids=lambda c: c.name)
def test_two_ranks_match_single_process(two_ranks, case):
    assert_parity(two_ranks[case.name], run_reference(case, 2), case.tolerance())
    if case.name.startswith("dps2-zero-offload-early"):  # the engine's step during backward reached through the layout
        assert two_ranks[case.name].steps_in_backward == case.steps


@pytest.mark.parametrize("case", _cases(4), ids=lambda c: c.name)
def test_four_ranks_match_single_process(four_ranks, case):
    assert_parity(four_ranks[case.name], run_reference(case, 4), case.tolerance())


@pytest.mark.parametrize("case", _cases(8), ids=lambda c: c.name)
def test_eight_ranks_match_single_process(eight_ranks, case):
    assert_parity(eight_ranks[case.name], run_reference(case, 8), case.tolerance())
