"""Errors a user fixes in the configuration, not in the code."""

from __future__ import annotations


class ConfigurationError(ValueError):
    """A run that cannot go on as configured (a layout the model does not divide into, a loop the module has no step
    for, a plan that fits nothing): every rank raises it alike, so the ranks part without aborting each other; the
    command line prints it once, from rank 0, as one ``error:`` block and exits with code 2."""
