"""ZeRO-1, ZeRO-2 and ZeRO-Offload at 2 and 3 ranks against the single-process reference."""

from __future__ import annotations

import pytest

from tests.parity.harness import Case, assert_parity, run_reference, run_world
from trainkit_strategies.offload import host_adam, native

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

SMALL = {"bucket_mb": 0.0004}  # several buckets per param group on the 8-16-1 MLP

CASES = [
    case
    for name, options in (("zero1", SMALL), ("zero2", SMALL), ("zero_offload", {**SMALL, "ratio": 0.5}))
    for case in (
        Case(f"{name}-acc1", name, options),
        Case(f"{name}-acc4-clip", name, options, accumulate=4, clip=0.05),
        Case(f"{name}-acc4-num_items", name, options, accumulate=4, model="masked"),
        Case(f"{name}-bf16-acc4-clip", name, options, precision="bf16-mixed", accumulate=4, clip=0.05),
    )
] + [
    Case("zero2-one-bucket-clip", "zero2", {}, clip=0.05),
    Case("zero2-fp16-acc2-clip", "zero2", SMALL, precision="16-mixed", accumulate=2, clip=0.05,
         init_scale=1024.0),
    Case("zero2-bf16-true-acc2", "zero2", SMALL, precision="bf16-true", accumulate=2),
    # ZeRO-Offload with every bucket on the host: the host gradient partition and the chunked fused step
    Case("zero_offload-host-fp32-acc2", "zero_offload", SMALL, accumulate=2),
    Case("zero_offload-host-bf16-clip", "zero_offload", SMALL, precision="bf16-mixed", clip=0.05),
    Case("zero_offload-host-fp32-acc2-clip-value", "zero_offload", SMALL, accumulate=2, clip=0.01,
         clip_algorithm="value"),
    Case("zero_offload-host-fp16-acc2-clip", "zero_offload", SMALL, precision="16-mixed", accumulate=2, clip=0.05,
         init_scale=1024.0),
    # ... and stepping each bucket on the host during backward (no hook reads the gradients, no clipping; on by
    # default only where the device is not the host, asked for here)
    Case("zero_offload-overlap-fp32", "zero_offload", {**SMALL, "overlap_step": True}, probe_grads=False),
    Case("zero_offload-overlap-bf16-acc4-num_items", "zero_offload", {**SMALL, "ratio": 0.5, "overlap_step": True},
         precision="bf16-mixed", accumulate=4, model="masked", probe_grads=False),
    # gradients summed across ranks in fp32 under bf16-mixed (reduce_dtype), whole and partitioned, and offloaded
    Case("zero1-bf16-reduce-fp32-acc2", "zero1", SMALL, precision="bf16-mixed", reduce_dtype="fp32", accumulate=2,
         clip=0.05),
    Case("zero2-bf16-reduce-fp32-acc2", "zero2", SMALL, precision="bf16-mixed", reduce_dtype="fp32", accumulate=2),
    Case("zero_offload-bf16-reduce-fp32", "zero_offload", SMALL, precision="bf16-mixed", reduce_dtype="fp32",
         accumulate=2, clip=0.05),
    # the bytes on the wire, on an MLP whose buckets' padding is small beside its parameters (1,281): the bound
    # below then tells one send from two, as the last case (sending everything twice) shows
    Case("zero1-comm-acc4", "zero1", SMALL, accumulate=4, steps=3, record_comm=True, model="wide"),
    Case("zero2-comm-acc1", "zero2", SMALL, steps=3, record_comm=True, model="wide"),
    Case("zero2-comm-sends-twice", "zero2", SMALL, steps=3, record_comm=True, model="wide", sends_twice=True),
]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def world(request):
    return request.param, run_world(request.param, CASES)


@pytest.mark.parametrize("case", [c for c in CASES if not c.record_comm], ids=lambda c: c.name)
def test_zero_matches_single_process(world, case):
    world_size, results = world
    result = results[case.name]
    assert_parity(result, run_reference(case, world_size), case.tolerance())
    overlapped = case.strategy == "zero_offload" and not case.probe_grads
    assert result.steps_in_backward == (case.steps if overlapped else 0)  # the path the case means to test
    # host steps ran the compiled kernel wherever it builds (with a C compiler: here, and in CI)
    assert result.host_fallback == ("" if host_adam.uses_kernel() else native.why_not("host_adam"))


def _moves_psi_once(moved: dict[str, int], psi: int) -> None:
    """One reduce-scatter in and one all-gather out, each Ψ fp32 values plus the buckets' padding: at least Ψ, and
    less than twice Ψ (the padding, at most W·16 values a bucket, is below Ψ here)."""
    assert moved.keys() == {"reduce_scatter", "all_gather"}
    assert moved["reduce_scatter"] == moved["all_gather"]
    assert psi * 4 <= moved["reduce_scatter"] < 2 * psi * 4, (moved, psi)


def test_zero1_reduce_scatters_and_gathers_psi_per_step_and_nothing_on_micro_steps(world):
    _, results = world
    result = results["zero1-comm-acc4"]
    assert len(result.comm) == 12
    for i, moved in enumerate(result.comm):
        if (i + 1) % 4:
            assert moved == {}, f"micro-step {i} communicated {moved}"
        else:
            _moves_psi_once(moved, result.psi)


def test_zero2_moves_psi_each_way_per_step(world):
    _, results = world
    result = results["zero2-comm-acc1"]
    assert len(result.comm) == 3
    for moved in result.comm:
        _moves_psi_once(moved, result.psi)


def test_a_strategy_that_sends_twice_fails_the_bytes_test(world):
    """The guard of the two tests above: the same zero2 run with every collective sent a second time fails."""
    _, results = world
    result = results["zero2-comm-sends-twice"]
    assert len(result.comm) == 3
    with pytest.raises(AssertionError):
        _moves_psi_once(result.comm[0], result.psi)
    assert result.comm[0]["reduce_scatter"] == 2 * results["zero2-comm-acc1"].comm[0]["reduce_scatter"]
