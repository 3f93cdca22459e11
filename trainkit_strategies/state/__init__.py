"""State and checkpoints: a strategy's state as pieces of named global tensors (``pieces.py``), how a strategy maps
its tensors to those pieces and loads any checkpoint's ranges back (``checkpointing.py``), flat buffers split into
equal pieces across ranks (``flat.py``) and the fp32 master weights over them (``master.py``)."""
