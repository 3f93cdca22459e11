"""Data: DataModule, and the sampler that shards by rank and resumes mid-epoch.

The sampler keeps the *global* sample order independent of the world size: each epoch draws one
permutation (seeded by ``seed + epoch``) and rank ``r`` of ``W`` takes ``perm[r::W]``. With a per-rank
batch ``b``, the ranks' batches at step ``t`` together hold exactly ``perm[t*W*b : (t+1)*W*b]``, the
batch one process with batch ``W*b`` would see, which is what makes strategy parity testable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from trainkit_strategies.errors import ConfigurationError


class DataModule:
    """Groups the data of a run: override the ``*_dataloader`` methods you need.

    ``prepare_data`` runs once (rank 0) for downloads; ``setup(stage)`` runs on every rank.
    """

    def prepare_data(self) -> None: ...

    def setup(self, stage: str) -> None: ...

    def teardown(self, stage: str) -> None: ...

    def train_dataloader(self) -> DataLoader | None:
        return None

    def val_dataloader(self) -> DataLoader | None:
        return None

    def test_dataloader(self) -> DataLoader | None:
        return None

    def predict_dataloader(self) -> DataLoader | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` if a DataLoader can take it: refused in a DataModule's constructor, where the command line
    builds it before any rank starts, instead of as torch's traceback from every rank once the run has begun."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be >= 1 (the samples in one rank's batch); got {batch_size!r}.")
    return batch_size


# What validate, test and predict take as their loaders (a DataModule there is the datamodule, as in Lightning).
EvalLoaders = DataLoader | Sequence[DataLoader] | DataModule | None


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices, sharded across ranks by striding, resumable mid-epoch.

    When the dataset does not divide by the world size, training pads the permutation with its own
    head (as torch's DistributedSampler does) so every rank takes the same number of steps, unless
    ``drop_last`` trims it. Evaluation uses ``pad=False``: ranks may then see one sample fewer, but no
    sample is counted twice in a metric.
    """

    def __init__(
        self, length: int, shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1,
        drop_last: bool = False, pad: bool = True,
    ) -> None:
        self.length, self.shuffle, self.seed = length, shuffle, seed
        self.rank, self.world_size, self.drop_last, self.pad = rank, world_size, drop_last, pad
        self.epoch = 0
        self._skip: tuple[int, int] | None = None  # (epoch, samples) to skip in that epoch only
        if drop_last:
            self.per_rank = length // world_size
        elif pad:
            self.per_rank = math.ceil(length / world_size)
        else:
            self.per_rank = len(range(rank, length, world_size))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, samples: int) -> None:
        """Start the current epoch's next iteration ``samples`` into this rank's share."""
        self._skip = (self.epoch, samples)

    def _start(self) -> int:
        return self._skip[1] if self._skip is not None and self._skip[0] == self.epoch else 0

    def __len__(self) -> int:
        """The whole epoch's share, also while resuming: loops count batches from the epoch's start."""
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._start(), None
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=gen)
        else:
            order = torch.arange(self.length, device="cpu")
        total = self.per_rank * self.world_size if self.pad or self.drop_last else self.length
        if total > self.length:
            order = torch.cat([order, order.repeat(math.ceil(total / self.length))[: total - self.length]])
        return iter(order[:total][self.rank :: self.world_size][start:].tolist())


def rebuild_loader(
    loader: Iterable[Any], shuffle: bool | None, seed: int, rank: int, world_size: int, pad: bool = True
) -> Iterable[Any]:
    """Swap a loader's default sampler for a ``ResumableSampler``; other loaders pass through.

    Loaders with a custom sampler or batch sampler, over an IterableDataset, or any other iterable of
    batches (a list, say) are left alone: they resume by skipping batches, and sharding across ranks
    is theirs to do.
    """
    if not isinstance(loader, DataLoader):
        if world_size > 1:
            rank_zero_warn("A dataloader is a plain iterable, so trainkit cannot shard it by rank: make sure each "
                           "rank reads its own part of the data.")
        return loader
    default_sampler = type(loader.sampler) in (SequentialSampler, RandomSampler)
    if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None or not default_sampler:
        if world_size > 1 and not isinstance(getattr(loader, "sampler", None), ResumableSampler):
            rank_zero_warn(
                "A dataloader uses a custom sampler or an IterableDataset, so trainkit cannot shard it by "
                "rank: make sure each rank reads its own part of the data."
            )
        return loader
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = ResumableSampler(len(loader.dataset), shuffle, seed, rank, world_size, pad=pad)
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator if loader.generator is not None else torch.Generator(),
        persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def num_batches(loader: Iterable[Any], limit: int | float | None) -> float:
    """Batches per epoch after ``limit`` (an int count or a fraction); ``inf`` when unknown."""
    try:
        total: float = len(loader)
    except TypeError:
        total = math.inf
    if limit is None:
        return total
    if isinstance(limit, float) and limit <= 1.0:
        if math.isinf(total):
            raise ValueError("A fractional limit_*_batches needs a dataloader with a length.")
        return int(total * limit)
    return min(total, int(limit))


class DataConnector:
    """A run's dataloaders: where they come from, the sampler they get, and how batches reach the device.

    Loaders passed to ``fit``/``validate``/... win over a DataModule's, which win over the module's own
    ``*_dataloader`` methods. With ``use_distributed_sampler`` a loader's default sampler is replaced by
    a ``ResumableSampler`` sharded by data-parallel rank (the stages of one pipeline replica share data).
    """

    _HOOKS = {"fit": "val_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
              "predict": "predict_dataloader"}

    def __init__(self, strategy: Callable[[], Any], precision: Any, use_distributed_sampler: bool, seed: int,
                 overfit: bool = False) -> None:
        self._strategy, self.precision = strategy, precision
        self.use_distributed_sampler, self.seed = use_distributed_sampler, seed
        self.overfit = overfit  # overfit_batches: every loader in order, never shuffled (Lightning's)
        self.train_dataloader: Any = None
        self.val_dataloaders: list[Any] = []
        self._source: Any = None
        self._train_arg: Any = None
        self._source_train: Any = None  # the run's training loader as given (asked for once per run)
        self._evaluation: Any = None  # the evaluation loaders passed to the run, if any
        self._sharded_for: Any = None  # the strategy ``train_dataloader`` was sharded by

    def prepare(self, source: Any, train: Any) -> None:
        """A new run: ``source`` (a DataModule or the module) supplies what ``train`` (fit's loaders) does not."""
        self._source, self._train_arg = source, train
        self.train_dataloader, self.val_dataloaders = None, []
        self._source_train: Any = None

    def connect(self, fn: str, evaluation: Any) -> None:
        """Build the loaders ``fn`` ("fit", "validate", "test", "predict") uses; ``evaluation`` is the loaders
        passed for validation/test/prediction, if any."""
        if fn == "fit":
            self.train()
        self._evaluation = evaluation
        hook = self._HOOKS[fn]
        loaders = evaluation if evaluation is not None else getattr(self._source, hook)()
        if loaders is None:
            loaders = []
        elif isinstance(loaders, DataLoader):
            loaders = [loaders]
        if fn != "fit" and not loaders:
            source = ("the DataModule " if isinstance(self._source, DataModule) else "the module ") + \
                type(self._source).__name__
            raise ConfigurationError(
                f"No {fn} data: {source} has no {hook}(). Define {hook}() in the module or its DataModule (--data "
                f"CLASS on the command line), or pass dataloaders to Trainer.{fn}()."
            )
        self.val_dataloaders = [self._rebuild(dl, shuffle=False, pad=False) for dl in loaders]

    def reload(self) -> None:
        """A fit's loaders built again from their source (``reload_dataloaders_every_n_epochs``); loaders passed to
        ``fit`` come back as they are, as in Lightning."""
        self._source_train = self.train_dataloader = None
        self.connect("fit", self._evaluation)

    @property
    def strategy(self) -> Any:
        """The run's strategy, asked for when it is used (``strategy="auto"`` decides it as fit starts)."""
        return self._strategy()

    def source_train(self) -> Any:
        """The training loader as the user gave it (before trainkit's sampler shards it by data-parallel rank)."""
        if self._source_train is not None:
            return self._source_train
        loader = self._train_arg if self._train_arg is not None else self._source.train_dataloader()
        if loader is None:
            raise ConfigurationError(
                "No training data: pass train_dataloaders to fit(), a datamodule (--data CLASS on the command line, "
                "for example --data trainkit.demo.markov.MarkovData), or implement train_dataloader() on the module."
            )
        self._source_train = loader
        return loader

    def train(self) -> Any:
        """The training loader, sharded by the run's strategy as it stands: under ``strategy="auto"`` a module
        planned as fit starts may ask for it (``estimated_stepping_batches`` in ``configure_optimizers``) while the
        planner's strategy holds the ranks, and the chosen one may split them otherwise (a tensor-parallel layout)."""
        if self.train_dataloader is None or self._sharded_for is not self.strategy:
            self.train_dataloader = self._rebuild(self.source_train(), shuffle=None, pad=True)
            self._sharded_for = self.strategy
        return self.train_dataloader

    def _rebuild(self, loader: Any, shuffle: bool | None, pad: bool) -> Any:
        if self.overfit and isinstance(getattr(loader, "sampler", None), RandomSampler):
            rank_zero_warn("overfit_batches turns the shuffling of a dataloader off: it reads the same batches, in "
                           "order, every epoch (as Lightning does).")
            if not self.use_distributed_sampler:  # in order, unsharded
                return rebuild_loader(loader, False, self.seed, 0, 1, pad=pad)
        if self.overfit:
            shuffle = False
        if not self.use_distributed_sampler:
            return loader
        return rebuild_loader(loader, shuffle, self.seed, self.strategy.dp_rank, self.strategy.dp_size, pad=pad)

    @property
    def equal_batches(self) -> bool:
        """Every rank's training batches hold as many samples: the loader draws through trainkit's sampler, which
        gives every rank a share of the same length (padded or trimmed)."""
        sampler = getattr(self.train_dataloader, "sampler", None)
        return isinstance(sampler, ResumableSampler) and (sampler.pad or sampler.drop_last)

    @property
    def moves_batches(self) -> bool:
        """Whether batches need moving to the device or casting (to bf16 under "bf16-true")."""
        return self.strategy.device.type != "cpu" or self.precision.converts_input

    def to_device(self, batch: Any) -> Any:
        """``batch`` on this rank's device, with the precision policy's input cast applied."""
        return self.precision.convert_input(move_to_device(batch, self.strategy.device))


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` on ``device`` (non-blocking: pinned host memory copies asynchronously)."""
    if device.type == "cpu":
        return batch
    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(device, non_blocking=True))
