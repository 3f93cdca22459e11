"""``Trainer(compile=True)`` against one eager process on the global batch, fp32 within 1e-5 (CPU inductor), on the
demo GPT with accumulation and clipping: one process, ddp, zero2, fsdp, tensor parallelism (tp=2) and a two-stage
pipeline, each with activation checkpointing off and on. Each block is compiled once: no graph is made after the
first optimizer step (a recompilation per step would show here)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.helpers import accelerator_for
from tests.parity.harness import Case, assert_parity, run_case, run_reference, run_world

pytestmark = [
    pytest.mark.slow,  # processes of their own, and inductor's compilation (see conftest.py)
    pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")),
                       reason="inductor compiles C++ for the CPU: this machine has no C++ compiler (set CXX)"),
]

LAYOUTS = {"ddp": ("ddp", {}), "zero2": ("zero2", {}), "fsdp": ("fsdp", {}), "tp2": ("parallel", {"tp": 2}),
           "pipeline": ("pipeline", {"stages": 2})}
CHECKPOINTING = {"eager-blocks": False, "full-checkpointing": True, "selective-checkpointing": "selective"}


def _case(name: str, strategy: str, options: dict, checkpointing: bool | str) -> Case:
    return Case(name, strategy, options, model="gpt", accumulate=2, clip=0.05, steps=4, compile=True,
                checkpointing=checkpointing)


CASES = [_case(f"{layout}-{ac}", strategy, options, checkpointing)
         for layout, (strategy, options) in LAYOUTS.items() for ac, checkpointing in CHECKPOINTING.items()]


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_world(2, CASES)


def _assert_compiled_once(graphs: list[int]) -> None:
    after_first_step, at_end = graphs
    assert after_first_step > 0, "nothing was compiled"
    assert at_end == after_first_step, f"{at_end - after_first_step} graphs compiled after the first step"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_two_ranks_match_one_eager_process(two_ranks, case):
    result = two_ranks[case.name]
    assert_parity(result, run_reference(case, 2), case.tolerance())
    _assert_compiled_once(result.graphs)


@pytest.mark.parametrize("checkpointing", CHECKPOINTING.values(), ids=CHECKPOINTING.keys())
def test_compiled_single_process_matches_eager(checkpointing):
    case = _case("single", "single", {}, checkpointing)
    result = run_case(case, 1, case.per_rank_batch, accelerator_for(1))
    assert_parity(result, run_reference(case, 1), case.tolerance())
    _assert_compiled_once(result.graphs)
