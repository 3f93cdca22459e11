"""Reduction precision is one policy: ``reduce_dtype`` is set once (``Trainer(reduce_dtype=...)``,
``--trainer.reduce_dtype``), checked once by ``Precision``, and read by every strategy at setup; a strategy that
cannot reduce in it refuses it, and the old spelling (a strategy's option) is refused with where it is set now."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainkit.cli import main
from trainkit.trainer import Trainer
from trainkit_strategies import Precision, get_strategy
from trainkit_strategies.errors import ConfigurationError

NEW_PLACE = r"--trainer\.reduce_dtype fp32.*Trainer\(reduce_dtype=\"fp32\"\)"


def test_the_policy_carries_reduce_dtype_and_defaults_to_the_gradients_own_dtype():
    default, fp32 = Precision.from_name("bf16-mixed"), Precision.from_name("bf16-mixed", reduce_dtype="fp32")
    assert default.reduce_dtype is None and default.grad_dtype == torch.bfloat16  # the working parameters'
    assert fp32.reduce_dtype == fp32.grad_dtype == torch.float32
    assert Precision.from_name("16-mixed", reduce_dtype="bfloat16").grad_dtype == torch.bfloat16
    assert Precision.from_name("16-mixed", reduce_dtype="fp32").scaler is not None  # the loss scaler kept


@pytest.mark.parametrize("build", [lambda: Precision.from_name("bf16-mixed", reduce_dtype="float64"),
                                   lambda: Trainer(precision="bf16-mixed", reduce_dtype="float64", logger=False)],
                         ids=["policy", "trainer"])
def test_a_reduce_dtype_of_no_known_name_is_refused_naming_the_value(build):
    with pytest.raises(ValueError, match=r"reduce_dtype must be one of \['bf16', .*\]; got 'float64'"):
        build()


@pytest.mark.parametrize("options", [{"name": "zero2"}, {"name": "fsdp"}, {"name": "parallel", "tp": 1}],
                         ids=["zero2", "fsdp", "parallel"])
def test_the_old_strategy_option_is_refused_naming_the_trainer(options):
    with pytest.raises(ConfigurationError, match=rf"no longer a strategy option.*{NEW_PLACE}"):
        get_strategy(**options, reduce_dtype="fp32")


def test_the_old_command_line_option_is_refused_naming_the_new_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args=["fit", "--trainer.strategy", "zero2", "--trainer.strategy.reduce_dtype", "fp32",
                   "--trainer.max_steps", "1"])
    said = capsys.readouterr().err
    assert exit_.value.code == 2
    assert said.startswith("trainkit: error: ") and "Traceback" not in said, said
    assert "Option 'reduce_dtype' is not accepted" in said and "--trainer.reduce_dtype fp32" in said, said


def test_the_command_line_sets_it_on_the_trainer():
    from trainkit.cli import build_parser, normalize_argv

    parser = build_parser()
    cfg = parser.parse_args(normalize_argv(["fit", "--trainer.precision", "bf16-mixed", "--trainer.reduce_dtype",
                                            "fp32", "--trainer.strategy", "zero2", "--trainer.logger", "false"]))
    trainer = Trainer(**dict(parser.instantiate(cfg).fit.trainer))
    assert trainer.precision.reduce_dtype == torch.float32 and trainer.strategy.name == "zero2"


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_a_strategy_that_reduces_in_the_parameters_dtype_refuses_another(name):
    """single and ddp keep gradients where autograd leaves them, in the parameters' dtype (fp32 under bf16-mixed):
    reduce_dtype fp32 is what they do; bf16 they cannot keep, and say so instead of ignoring it."""
    get_strategy(name).setup(nn.Linear(2, 2), None, Precision.from_name("bf16-mixed", reduce_dtype="fp32"))
    with pytest.raises(ConfigurationError, match=rf"{name} sums gradients in the parameters' dtype \(torch.float32\)"
                                                 r".*reduce_dtype=torch.bfloat16.*zero1, zero2"):
        get_strategy(name).setup(nn.Linear(2, 2), None, Precision.from_name("bf16-mixed", reduce_dtype="bf16"))
