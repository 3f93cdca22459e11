"""Materialising parameters built on the meta device, one sharding unit at a time.

Sharded strategies build the model inside ``configure_model`` on the meta device while an
``InitRecorder`` (``deferred.py``) logs what the code computes. When a unit is sharded, its meta
parameters become real ones placed straight into the unit's flat buffer (``homes``), with the values
the log replays for them, so a rank never holds more than its shards plus one unit and every tensor
gets the value a one-process run gives it (custom ``nn.init`` calls, factories and random draws
included). A module whose tensors the log cannot rebuild falls back to its ``reset_parameters()``
(and the model's ``init_weights(module)`` if it has one), with a warning.
"""

from __future__ import annotations

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor, nn

from trainkit_strategies.sharding.deferred import Replayer


def materialise_meta(root: nn.Module, homes: dict[Tensor, Tensor], replayer: Replayer | None,
                     device: torch.device) -> dict[Tensor, nn.Parameter]:
    """Give the meta parameters among ``homes`` (parameter -> its place in a unit's buffer) real storage and
    values; returns each replaced meta parameter's new parameter.

    A module is materialised once, all its parameters together, even those another unit shards (they get
    storage of their own, copied into their unit later). Meta buffers of every module are materialised too.
    """
    replaced: dict[Tensor, nn.Parameter] = {}
    for mod in root.modules():
        if not any(p is not None and p in homes and p.is_meta for p in mod._parameters.values()):
            continue
        metas = {n: p for n, p in mod._parameters.items() if p is not None and p.is_meta}
        buffers = {n: b for n, b in mod._buffers.items() if b is not None and b.is_meta}
        replay = replayer is not None and all(replayer.knows(t) for t in [*metas.values(), *buffers.values()])
        reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
        if not replay and reset is None:
            raise TypeError(
                f"{type(mod).__name__} was built on the meta device (in configure_model) in a way trainkit "
                "cannot replay, and has no reset_parameters() to initialise it; define reset_parameters() or "
                "build this module in __init__ instead of configure_model."
            )
        if not replay and replayer is not None:
            rank_zero_warn(f"{type(mod).__name__}'s tensors were computed in configure_model in a way trainkit "
                           "cannot replay; they are initialised by its reset_parameters() instead, so they "
                           "differ from a one-process run.")
        for old in metas.values():
            home = homes.get(old)
            data = home if home is not None else torch.empty_like(old, device=device, dtype=torch.float32)
            new = nn.Parameter(data, requires_grad=old.requires_grad)
            for owner in root.modules():
                for key, value in owner._parameters.items():
                    if value is old:
                        owner._parameters[key] = new
            replaced[old] = new
        for name, buf in buffers.items():
            mod._buffers[name] = torch.empty_like(buf, device=device)
        with torch.no_grad():
            if replay:
                assert replayer is not None
                for name, old in metas.items():
                    replayer.fill(old, mod._parameters[name].data)
                for name, old in buffers.items():
                    replayer.fill(old, mod._buffers[name])
            else:
                reset()
                custom = getattr(root, "init_weights", None)
                if callable(custom):  # the model's own initialisation, module by module
                    custom(mod)
    for mod in root.modules():  # buffers of modules without parameters
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros_like(buf, device=device)
                if replayer is not None and replayer.knows(buf):
                    replayer.fill(buf, mod._buffers[name])
    return replaced
