"""trainkit's ``single`` held to a plain PyTorch loop (tests/parity/plain.py), for every model and precision the
parity suite trains; and the guards of the low-precision tolerance: runs known to be wrong must fail it.

Every multi-rank parity test compares a strategy with ``run_reference``, which holds ``single`` to the plain loop
before returning it: each strategy and layout is compared with plain PyTorch through ``single``. The cases here tie
``single`` itself to the loop under each precision, model (the MLP, BatchNorm, a torchmetrics metric logged with
sync_dist, the demo GPT, the llama and MoE examples, a Hugging Face llama) and validation metric.
"""

from __future__ import annotations

import pytest

from tests.parity.harness import (
    FP32,
    Case,
    assert_anchored,
    assert_parity,
    derive_tolerance,
    run_case,
    run_plain,
    run_reference,
)

PRECISIONS = ("32", "bf16-mixed", "bf16-true", "16-mixed")
BF16_BEFORE = {"rtol": 2e-2, "atol": 2e-2}  # every bf16 parity case's tolerance until it was derived from the run
MODELS = ("regression", "validated", "batchnorm", "gpt", "llama", "moe", "hf_llama")


def _case(model: str, precision: str) -> Case:
    return Case(f"{model}-{precision}", "single", model=model, precision=precision, accumulate=2, clip=1.0,
                validate=model in ("validated", "batchnorm", "gpt"),
                init_scale=128.0 if precision == "16-mixed" else None)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
def test_single_matches_a_plain_pytorch_loop(model, precision):
    """Two ranks' worth of data (batches of 8), accumulation 2, clipping at 1.0 (it bites on the MLP), 10 steps."""
    case = _case(model, precision)
    single = run_case(case, 2, case.per_rank_batch * 2, "cpu")
    plain = run_plain(case, 2)
    tolerance = FP32 if precision == "32" else derive_tolerance(case, 2, plain)
    assert_anchored(single, plain, tolerance)
    if case.validate:
        assert plain.val and plain.val.keys() <= single.val.keys()  # the metrics were compared


# The case: ddp's bf16_acc4_clip (the MLP, bf16-mixed, accumulation 4, clipping at 0.05) on two ranks; its
# fp16 and bf16-true siblings
GUARDED = {
    "bf16-mixed": Case("bf16_acc4_clip", "ddp", precision="bf16-mixed", accumulate=4, clip=0.05),
    "16-mixed": Case("fp16_acc2_clip", "ddp", precision="16-mixed", accumulate=2, clip=0.05, init_scale=1024.0),
    "bf16-true": Case("bf16_true_acc2_clip", "ddp", precision="bf16-true", accumulate=2, clip=0.05),
}
WRONG = [("bf16-mixed", "no_clip"), ("bf16-mixed", "fp32"), ("16-mixed", "no_clip"), ("16-mixed", "fp32"),
         ("16-mixed", "no_unscale"), ("bf16-true", "no_clip"), ("bf16-true", "fp32")]


@pytest.mark.parametrize(("precision", "variant"), WRONG, ids=[f"{p}-{v}" for p, v in WRONG])
def test_a_run_known_to_be_wrong_fails_the_derived_tolerance(precision, variant):
    """Without clipping, in fp32 where bf16 or fp16 was asked for, or stepping on gradients still multiplied by the
    loss scale: each fails against the reference. The fixed bf16 tolerance used before (rtol = atol = 2e-2) let the
    first two through on bf16_acc4_clip."""
    case = GUARDED[precision]
    reference = run_reference(case, 2)
    wrong = run_plain(case, 2, variant)
    with pytest.raises(AssertionError):
        assert_parity(wrong, reference)


@pytest.mark.parametrize("variant", ["no_clip", "fp32"])
def test_the_fixed_bf16_tolerance_could_not_see_them(variant):
    """Why the tolerance is derived: the fixed one passed both wrong runs of bf16_acc4_clip."""
    case = GUARDED["bf16-mixed"]
    assert_parity(run_plain(case, 2, variant), run_reference(case, 2), BF16_BEFORE)


@pytest.mark.parametrize("precision", list(GUARDED))
def test_the_legitimate_roundings_pass_the_derived_tolerance(precision):
    """What the tolerance is derived from passes it by construction; the plain loop on three ranks' pieces (a split
    the derivation for two ranks does not use) must pass it too."""
    case = GUARDED[precision]
    assert_parity(run_plain(case, 2, None, 3), run_reference(case, 2))
