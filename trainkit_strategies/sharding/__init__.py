"""Parameter sharding (ZeRO-3, FSDP): one engine (``engine.py``) and its two policies for grouping modules into
units (``zero3.py`` by size, ``fsdp.py`` by layer), with sharded initialisation from the meta device."""
