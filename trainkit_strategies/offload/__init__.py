"""Host offload: pinned host memory and bulk copies across the bus (``hostcopy.py``), the host Adam (``host_adam.py``)
and the C kernel it runs (``csrc/host_adam.c``, built on first use by ``native.py``)."""
