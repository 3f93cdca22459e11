"""Which units the sharding engine keeps gathered, and the order it prefetches them in (one process)."""

from __future__ import annotations

import torch
from torch import nn

from trainkit_strategies import Environment, Precision, get_strategy
from trainkit_strategies.sharding.units import UnitOrder


def test_the_order_is_recorded_once_then_followed_and_a_deviation_is_noticed():
    order = UnitOrder()
    order.restart("forward")
    assert [order.follow("forward", u) for u in (1, 2, 3)] == [None, None, None]  # the first pass records
    order.restart("forward")
    assert [order.follow("forward", u) for u in (1, 2, 3)] == [2, 3, None] and not order.deviated
    order.restart("forward")
    assert order.follow("forward", 2) is None and order.deviated


def _gathered(strategy) -> list[bool]:
    return [any(b.gathered.untyped_storage().nbytes() for b in u.buckets) for u in strategy.units]


def test_the_last_unit_of_a_training_forward_stays_gathered_for_backward_and_nothing_after_it():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
    strategy = get_strategy("fsdp")
    strategy.setup_environment(Environment())
    strategy.setup(model, torch.optim.AdamW(model.parameters()), Precision.from_name("32"))
    x = torch.randn(4, 8)
    for _ in range(2):
        with strategy.forward_context():
            loss = model(x).square().mean()
        assert _gathered(strategy) == [False, False, True]  # the last block: backward begins with it
        strategy.backward(loss)
        assert _gathered(strategy) == [False, False, False]
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
        strategy.zero_grad()
    with torch.no_grad(), strategy.forward_context():
        model(x)
    assert _gathered(strategy) == [False, False, False]  # no backward follows an evaluation


def test_a_sharded_module_and_its_strategy_are_freed_once_dropped():
    """The module's hooks hold the strategy (they gather its units) and the strategy holds the module; the garbage
    collector frees the pair once nothing else does, which it cannot while a hook on a parameter holds the strategy
    (autograd holds the parameters too, so their hooks are not followed): every fit under fsdp or zero3 left its model
    and optimizer state in memory."""
    import gc
    import weakref

    def fit_one(name: str) -> tuple[weakref.ref, weakref.ref]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
        strategy = get_strategy(name)
        strategy.setup_environment(Environment())
        strategy.setup(model, torch.optim.AdamW(model.parameters()), Precision.from_name("32"))
        with strategy.forward_context():
            loss = model(torch.randn(4, 8)).square().mean()
        strategy.backward(loss)
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
        strategy.teardown()
        assert model(torch.randn(2, 8)).shape == (2, 8)  # still usable after teardown, while held
        return weakref.ref(strategy), weakref.ref(model)

    for name in ("fsdp", "zero3"):
        strategy, model = fit_one(name)
        gc.collect()
        assert strategy() is None and model() is None, name
