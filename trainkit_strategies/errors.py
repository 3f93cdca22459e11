"""Errors a user fixes in the configuration, not in the code."""

from __future__ import annotations


class ConfigurationError(ValueError):
    """A run that cannot go on as configured (a layout the model does not divide into, a loop the module has no step
    for, a plan that fits nothing): every rank raises it alike, so the ranks part without aborting each other; the
    command line prints it once, from rank 0, as one ``error:`` block and exits with code 2."""


def groups_fixed(strategy: str, change: str) -> ConfigurationError:
    """The error of a strategy that cannot take ``change`` to what the optimizer trains after setup (a param group
    added with ``optimizer.add_param_group``, parameters frozen or unfrozen), with what can."""
    return ConfigurationError(
        f"{strategy} cannot change what the optimizer trains after setup: {change}. It planned its gradient buckets "
        "and optimizer-state shards at setup, by the param groups configure_optimizers returned and the parameters "
        "that had requires_grad then (Lightning's BaseFinetuning.unfreeze_and_add_param_group changes both). The "
        "strategies single and ddp take such changes mid-run (--trainer.strategy ddp). To stay under "
        f"{strategy}, build the optimizer with every param group in configure_optimizers, every parameter trainable "
        "(requires_grad=True), and hold a group still with lr=0 until it should train.")
