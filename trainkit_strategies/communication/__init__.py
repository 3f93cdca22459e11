"""Communication: the only module that calls torch.distributed (``comm.py``, every byte counted), where a rank runs
and where the ranks meet (``environment.py``), dead peers noticed (``liveness.py``), the layout of named axes and
their subgroups (``layout.py``), a counting communicator for planning (``plan_comm.py``) and norms across shards
(``norms.py``). Imports nothing else of trainkit_strategies but ``errors`` and ``precision``."""
