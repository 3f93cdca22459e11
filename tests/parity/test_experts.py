"""Expert parallelism against one process on the same global batches (fp32, accumulation 2, clipping, the balance
and z-losses on): examples/moe.py's Mixtral (4 experts per layer, top 2) with its experts divided over ep=2, alone
and with dp_shard=2, tp=2 (sequence parallel: each tensor-parallel rank routes its slice) and pp=2 (a stage's
auxiliary terms ride on its output's gradient); capacity routing with room for every assignment is dropless."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

LAYOUTS = {2: {"ep2": {"ep": 2}}, 4: {"ep2-dps2": {"ep": 2, "dp_shard": 2}, "ep2-tp2": {"ep": 2, "tp": 2},
                                      "ep2-pp2": {"ep": 2, "pp": 2}}}


def _cases(world: int) -> list[Case]:
    cases = [Case(name, "parallel", options, model="moe", accumulate=2, clip=0.05)
             for name, options in LAYOUTS[world].items()]
    if world == 2:
        cases.append(Case("ep2-capacity", "parallel", {"ep": 2}, model="moe_capacity", accumulate=2, clip=0.05))
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
