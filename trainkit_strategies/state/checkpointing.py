"""How a strategy's state maps to universal checkpoints (a part of every ``Strategy``): what this rank holds,
as pieces of whole tensors, and how to load any checkpoint's ranges back; whole parameters and gradients by name."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

from trainkit_strategies.capabilities import SelfReducing
from trainkit_strategies.errors import groups_fixed
from trainkit_strategies.state import pieces as st


class Checkpointing:
    """``state_layout`` (the holders of this rank's model and optimizer state), ``state_pieces`` and ``load_state``
    for checkpoints; ``local_state`` for per-rank state; ``full_parameters``/``full_gradients`` whole by name."""

    name: str
    accepts_new_groups: bool
    module: nn.Module | None
    optimizer: Optimizer | None
    _group_names: list[list[str]]

    def refresh_groups(self) -> None:
        """Record the optimizer's param groups as they are now, by parameter name: a group added during training
        (``optimizer.add_param_group`` in a callback, as Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``
        does) is then saved in checkpoints with the others, and re-created when one is loaded. The strategy calls it
        where it reads the groups (a save, a load); a strategy that planned buckets by the groups refuses
        (``master.FixedGroups``)."""
        if self.optimizer is not None and self.module is not None:
            self._group_names = st.group_names_of(self.optimizer, st.param_names(self.module))

    def _groups_changed(self) -> bool:
        """Whether the optimizer has more (or fewer) param groups than were recorded. Their number, not their tensors:
        a sharding strategy re-targets each group onto its pieces, keeping the groups."""
        return self.optimizer is not None and len(self.optimizer.param_groups) != len(self._group_names)

    def state_layout(self) -> st.StateLayout:
        """Describe the model and optimizer state this rank holds (replicated: everything, whole)."""
        if self._groups_changed():
            self.refresh_groups()
        shapes, model = self._whole_state(skip=set())
        holders = []
        if self.optimizer is not None:
            names = st.param_names(self.module)
            holders = [st.whole_holder(names[p], p, self.is_global_zero)
                       for g in self.optimizer.param_groups for p in g["params"]]
        return st.StateLayout(shapes, model, self.optimizer, holders, self._group_names)

    def _whole_state(self, skip: set[str]) -> tuple[dict[str, tuple[int, ...]], list[st.Holder]]:
        """Global shapes of every parameter and persistent buffer, and whole holders (rank 0 writes)
        for those not named in ``skip`` (the ones a sharded strategy describes itself)."""
        assert self.module is not None
        names = st.param_names(self.module)
        buffers = st.persistent_buffers(self.module)
        shapes = {n: tuple(p.shape) for p, n in names.items()} | {n: tuple(b.shape) for n, b in buffers}
        writer = self.is_global_zero
        holders = [st.whole_holder(n, p, writer) for p, n in names.items() if n not in skip]
        holders += [st.whole_holder(n, b, writer) for n, b in buffers]
        return shapes, holders

    def state_pieces(self) -> list[st.Piece]:
        prefix = self._local_prefix()
        local = [st.Piece(f"{prefix}{key}", tuple(t.shape), t.dtype, 0, t.numel(), t.detach().reshape(-1))
                 for key, t in self.local_state().items()]
        return st.collect_pieces(self.state_layout()) + local

    def local_state(self) -> dict[str, Tensor]:
        """State that differs between ranks and means something only at this world size (the error feedback of
        compressed communication). Checkpoints keep it under ``local/W<world>/rank<r>/``; a run resumed at
        another world size starts it afresh."""
        if isinstance(self.optimizer, SelfReducing):
            return {f"optimizer/{k}": v for k, v in self.optimizer.local_state().items()}
        return {}

    def load_local_state(self, state: dict[str, Tensor]) -> None:
        """Restore ``local_state`` (empty: start it afresh)."""
        if isinstance(self.optimizer, SelfReducing):
            self.optimizer.load_local_state({k[10:]: v for k, v in state.items() if k.startswith("optimizer/")})

    def _local_prefix(self) -> str:
        return f"local/W{self.world_size}/rank{self.rank}/"

    def optimizer_groups(self) -> list[dict]:
        """Param groups as names plus hyperparameters (JSON-ready)."""
        if self.optimizer is None:
            return []
        if self._groups_changed():  # a group added during training (add_param_group) is saved too
            self.refresh_groups()
        hyper = st.group_hyperparameters(self.optimizer)
        return [{"params": names, **h} for names, h in zip(self._group_names, hyper, strict=True)]

    def load_state(self, reader: st.Reader, groups: Sequence[dict] | None) -> None:
        """Fill model (and, when ``groups`` is given, optimizer) state from any checkpoint's ranges."""
        if groups is not None:
            self._add_saved_groups(groups)
        layout = self.state_layout()
        st.load_model(layout, reader)
        if groups is not None:
            st.load_optimizer(layout, reader, groups)
            self._load_local(reader)
        self._after_load()

    def _add_saved_groups(self, groups: Sequence[dict]) -> None:
        """Re-create the param groups the checkpoint holds after this run's own (``add_param_group`` during the saved
        run: a callback unfreezing part of the model), so that their optimizer state loads and the run goes on as
        the saved one would have. Their parameters train again (requires_grad), as they did once their group was
        added; a callback that froze some of them later restores that itself (``BaseFinetuning`` does)."""
        optimizer, module = self.optimizer, self.module
        if optimizer is None or module is None or len(groups) <= len(optimizer.param_groups):
            return
        own = len(optimizer.param_groups)
        by_name = {n: p for p, n in st.param_names(module).items()}
        added = groups[own:]
        if ([g["params"] for g in groups[:own]] != self._group_names
                or any(n not in by_name for g in added for n in g["params"])):
            return  # another model or optimizer: ``load_optimizer`` names the mismatch
        if not self.accepts_new_groups:
            raise groups_fixed(self.name, f"the checkpoint holds {len(added)} param group(s) added during training, "
                                          "which this run's optimizer would need again")
        for saved in added:
            params = [by_name[n] for n in saved["params"]]
            for p in params:
                p.requires_grad_(True)
            optimizer.add_param_group(st.saved_group(saved, params, optimizer.defaults))
        self.refresh_groups()

    def _load_local(self, reader: st.Reader) -> None:
        prefix = self._local_prefix()
        state = {}
        for key in reader.keys():
            if key.startswith(prefix):
                shape, _ = reader.info(key)
                state[key[len(prefix):]] = reader.read(key, 0, math.prod(shape)).view(shape).to(self.device)
        if not state and any(k.startswith("local/") for k in reader.keys()):
            warnings.warn(
                f"The checkpoint holds rank-local state (compression error feedback) for another world size than "
                f"this run's {self.world_size}; it starts from zero here.", stacklevel=2,
            )
        self.load_local_state(state)

    def _after_load(self) -> None:
        """Hook for strategies whose working copies derive from loaded masters."""

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter whole, by name, on every rank (collective where parameters are sharded)."""
        assert self.module is not None
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def full_gradients(self) -> dict[str, Tensor]:
        """Every reduced gradient whole, by name (collective where gradients are sharded); call it between
        ``reduce_gradients`` and ``zero_grad``. Parameters without a gradient are left out."""
        assert self.module is not None
        return {n: p.grad.detach() for n, p in self.module.named_parameters() if p.grad is not None}
