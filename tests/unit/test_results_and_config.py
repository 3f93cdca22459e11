"""Logging aggregation, configure_optimizers forms, precision policies, the loss scaler."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MeanMetric

from trainkit.results import Results
from trainkit_strategies import DynamicLossScaler, Precision


def _results() -> Results:
    return Results(lambda t, op: t)


def test_epoch_mean_is_weighted_by_batch_size():
    r = _results()
    r.loop = "validate"
    r.log("loss", torch.tensor(1.0), batch_size=1)
    r.log("loss", torch.tensor(4.0), batch_size=3)
    assert r.epoch_metrics() == {"loss": pytest.approx(3.25)}


def test_train_defaults_log_per_step_and_both_get_suffixes():
    r = _results()
    r.log("a", torch.tensor(2.0), prog_bar=True)
    r.log("b", 3.0, on_step=True, on_epoch=True, reduce_fx="max")
    r.log("b", 5.0, on_step=True, on_epoch=True, reduce_fx="max")
    assert r.step_metrics() == {"a": 2.0, "b_step": 5.0}
    assert r.epoch_metrics() == {"b_epoch": 5.0}
    assert r.local_values(prog_bar_only=True) == {"a": 2.0}


def test_torchmetrics_compute_and_reset_at_epoch_end():
    r = _results()
    r.loop = "validate"
    metric = MeanMetric()
    for v in (1.0, 2.0, 6.0):
        metric(torch.tensor(v))
        r.log("m", metric)
    assert r.epoch_metrics() == {"m": 3.0}
    assert metric.update_count == 0


def test_bad_log_values_are_named():
    r = _results()
    with pytest.raises(ValueError, match=r"'x'.*scalar"):
        r.log("x", torch.ones(3))
    with pytest.raises(ValueError, match="reduce_fx"):
        r.log("y", 1.0, reduce_fx="median")


def test_precision_policies():
    assert Precision.from_name("32").compute_dtype is None
    assert Precision.from_name("bf16-mixed").compute_dtype is torch.bfloat16
    assert Precision.from_name("16-mixed").loss_scaling
    assert Precision.from_name("bf16-true").param_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="Unknown precision 'fp8'"):
        Precision.from_name("fp8")


def test_true_precision_casts_floating_inputs_only():
    batch = {"x": torch.randn(2, 3), "ids": torch.arange(4), "meta": "keep"}
    cast = Precision.from_name("bf16-true").convert_input(batch)
    assert cast["x"].dtype is torch.bfloat16 and cast["ids"].dtype is torch.long and cast["meta"] == "keep"
    for name in ("32", "bf16-mixed", "16-mixed"):
        assert Precision.from_name(name).convert_input(batch) is batch


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    s.update(found_inf=True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()
