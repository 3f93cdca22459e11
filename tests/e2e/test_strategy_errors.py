"""Bad strategy configurations fail with messages that name the problem and the fix."""

from __future__ import annotations

import pytest

from tests.helpers import RoutedRegression, loader, quiet_trainer, regression_data
from trainkit.callbacks import Callback
from trainkit_strategies import Environment, get_strategy
from trainkit_strategies.ddp import DDPStrategy


def test_unused_parameter_without_find_unused_is_named(tmp_path):
    trainer = quiet_trainer(tmp_path, strategy=DDPStrategy(), max_steps=2)
    with pytest.raises(RuntimeError, match=r"net\.never\.weight.*find_unused_parameters=True"):
        trainer.fit(RoutedRegression(), loader(regression_data(16), 4))


def test_find_unused_parameters_keeps_unused_grads_none(tmp_path):
    class Look(Callback):
        seen: list[bool] = []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.seen.append(module.net.never.weight.grad is None and module.net.common.weight.grad is not None)

    look = Look()
    quiet_trainer(tmp_path, strategy=DDPStrategy(find_unused_parameters=True), max_steps=3, callbacks=[look]).fit(
        RoutedRegression(), loader(regression_data(16), 4))
    assert look.seen == [True, True, True]


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("zero3x", {}, "Unknown strategy 'zero3x'. Valid strategies: ddp, single, zero1"),
        ("ddp", {"bucket_mb": 0}, "ddp bucket_mb must be positive; got 0"),
        ("zero2", {"bucket_mb": -1}, "zero2 bucket_mb must be positive; got -1"),
        ("zero_offload", {"ratio": 1.5}, r"zero_offload ratio must be in \[0, 1\]; got 1.5"),
    ],
)
def test_bad_strategy_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        get_strategy(name, **options)


def test_single_refuses_several_processes():
    with pytest.raises(ValueError, match=r"world_size=2.*--trainer\.strategy ddp"):
        get_strategy("single").setup_environment(Environment(world_size=2))
