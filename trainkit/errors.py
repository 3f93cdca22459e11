"""Errors a user fixes in the configuration, not in the code."""

from __future__ import annotations

from trainkit_strategies.errors import ConfigurationError

__all__ = ["ConfigurationError", "MissingStep"]


class MissingStep(ConfigurationError):
    """The module lacks the step a loop runs (Lightning's MisconfigurationException for it)."""
