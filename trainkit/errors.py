"""Errors a user fixes in the configuration, not in the code."""

from __future__ import annotations


class ConfigurationError(ValueError):
    """A run that cannot start as configured: a loop the module has no step for, a plan that fits nothing. Every rank
    raises it alike, so the ranks part without aborting each other; the command line prints it once, from rank 0,
    as ``trainkit: error:``, and exits with code 2."""


class MissingStep(ConfigurationError):
    """The module lacks the step a loop runs (Lightning's MisconfigurationException for it)."""
