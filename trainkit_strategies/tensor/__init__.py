"""Tensor and sequence parallelism (Megatron-LM): the communication as autograd functions (``regions.py``), the
parallel layers (``layers.py``), the vocabulary-parallel cross-entropy (``loss.py``), and plans that say which
submodule of a model becomes which (``plan.py``)."""
