"""In-place activations right after a sharded unit's output (Lightning's GAN generator: LeakyReLU(0.2, inplace=True)
after every Linear and BatchNorm) under zero3 and fsdp at 2 ranks, held to data parallelism written out by hand."""

from __future__ import annotations

import pytest

from tests.parity.harness import FP32, Case, assert_parity, run_plain, run_world

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

CASES = [Case("leaky_fsdp", "fsdp", steps=6, model="leaky", validate=True, accumulate=2),
         Case("leaky_zero3", "zero3", {"persistence_threshold": 0, "bucket_mb": 0.0004}, steps=6, model="leaky",
              validate=True, accumulate=2)]


@pytest.fixture(scope="module")
def results():
    return run_world(2, CASES, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_inplace_activations_after_a_unit_match_a_plain_loop(results, case):
    """Every Linear and BatchNorm is a unit of its own; the plain loop (tests/parity/plain.py's "replicas") normalises
    each rank's part of the batch by its own statistics and keeps rank 0's, as the strategies broadcast them. Before
    the engine hooked its backward on the output tensors, the first in-place activation failed: "Output 0 of
    BackwardHookFunction is a view and is being modified inplace"."""
    plain = run_plain(case, 2, "replicas", split=2)
    plain.val["buffer_spread"] = 0.0  # one copy of the statistics: the replicas' spread is nothing
    assert {"val_loss", "val_mse", "buffer:net.3.running_mean"} <= plain.val.keys() | plain.params.keys()
    assert_parity(results[case.name], plain, FP32)
