"""Mixtures of experts: routing, dispatch (local and expert-parallel over all-to-all) and the layer."""
