"""Bad strategy configurations fail with messages that name the problem and the fix."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Regression, RoutedRegression, loader, quiet_trainer, regression_data
from trainkit.callbacks import Callback
from trainkit_strategies import Environment, get_strategy
from trainkit_strategies.data_parallel.ddp import DDPStrategy


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
        ("zero3x", {}, "Unknown strategy 'zero3x'. Valid strategies: ddp, fsdp, parallel, pipeline, single, zero1"),
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


def test_pipeline_refuses_a_module_without_pipeline_hooks(tmp_path):
    class Plain(Regression):
        pipeline_layers = None

    with pytest.raises(TypeError, match=r"needs Plain to define pipeline_layers.*docs/pipeline\.md"):
        quiet_trainer(tmp_path, strategy="pipeline", max_steps=1).fit(Plain(), loader(regression_data(8), 4))


def test_pipeline_refuses_parameters_outside_its_layers(tmp_path):
    class Stray(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match=r"parameters outside every layer of pipeline_layers.*scale"):
        quiet_trainer(tmp_path, strategy="pipeline", max_steps=1).fit(Stray(), loader(regression_data(8), 4))


def test_pipeline_runs_a_batch_smaller_than_its_micro_batch_count(tmp_path):
    trainer = quiet_trainer(tmp_path, strategy=get_strategy("pipeline", microbatches=4), max_epochs=1)
    trainer.fit(Regression(), loader(regression_data(11), 4))  # batches of 4, 4 and 3 samples
    assert trainer.global_step == 3
