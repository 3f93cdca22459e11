"""The composed layout: ``strategy="parallel"`` (``strategy.py``: every axis on one mesh) and its preset
``strategy="pipeline"`` (``pipeline.py``)."""
