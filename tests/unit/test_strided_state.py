"""Tensor-parallel parts in universal checkpoints: a row-parallel weight's part is a strided piece of the whole, and
any range of any part (or of the whole) reads back from pieces of any other split, checked element by element."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from trainkit import checkpoint as ckpt
from trainkit.export import export
from trainkit_strategies.state.pieces import Piece, Strided, overlaps
from trainkit_strategies.tensor.layers import Split


def _indices(start: int, stop: int, strided: Strided | None) -> list[int]:
    """The whole's flat index of every element of the range, one by one (the definition, not the rectangles)."""
    return [strided.index(u) if strided is not None else u for u in range(start, stop)]


def _random_range(rng: random.Random, shape: tuple[int, ...]) -> tuple[int, int, Strided | None]:
    numel = shape[0] * shape[1]
    if rng.random() < 0.3:
        lo = rng.randrange(numel)
        return lo, rng.randrange(lo + 1, numel + 1), None
    dim, ranks = rng.choice([(0, 1), (0, 2), (1, 2), (1, 4), (0, 4)])
    parts = rng.choice([p for p in (1, 2, 3) if shape[dim] % (p * ranks) == 0] or [1])
    split = Split(dim, ranks, parts) if shape[dim] % (parts * ranks) == 0 else Split(dim, 1)
    strided = Strided(*split.strides(shape, rng.randrange(split.ranks)))
    size = numel // split.ranks
    lo = rng.randrange(size)
    return lo, rng.randrange(lo + 1, size + 1), strided


def test_overlaps_name_exactly_the_shared_elements():
    rng = random.Random(0)
    for _ in range(400):
        shape = rng.choice([(6, 8), (12, 4), (4, 12), (24, 6)])
        a, b = _random_range(rng, shape), _random_range(rng, shape)
        want_a, want_b = _indices(*a), _indices(*b)
        shared = set(want_a) & set(want_b)
        seen = []
        for rows, cols, i, pitch, j, other_pitch in overlaps(*a, *b):
            for r, c in itertools.product(range(rows), range(cols)):
                x, y = i + r * pitch + c, j + r * other_pitch + c
                assert want_a[x - a[0]] == want_b[y - b[0]], (shape, a, b)
                seen.append(want_a[x - a[0]])
        assert sorted(seen) == sorted(shared), (shape, a, b)


class _Ranks(SimpleNamespace):
    """What ``commit`` asks of a strategy, for files written by several simulated ranks in one process."""

    def all_gather_object(self, obj):
        return self.gathered

    def barrier(self) -> None:
        pass


def _save(tmp_path, name: str, files: list[list[Piece]]):
    strategy = _Ranks(is_global_zero=True, world_size=len(files), rank=0, gathered=[])
    staged = ckpt.begin(tmp_path, name, strategy, {}, {})
    written = [ckpt.write_rank_file(staged.tmp, r, pieces) for r, pieces in enumerate(files)]
    strategy.gathered = [(w.files, w.table, {}, None) for w in written]
    return ckpt.commit(staged, strategy, written[0])


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_a_checkpoint_of_parts_reads_back_in_any_split_and_exports_whole(tmp_path, dp):
    """Rows of a row-parallel weight (tp=2) and a fused q/k/v column-parallel weight (3 parts, tp=2), each part further
    cut into ``dp`` flat ranges as a sharded data-parallel strategy holds it: every rank file holds strided pieces.
    Reading back gives the whole, ranges of it, the parts of tp=1, 2 and 4 and of a split with another stride."""
    gen = torch.Generator().manual_seed(0)
    wholes = {"model/row": torch.randn(6, 8, generator=gen), "model/qkv": torch.randn(12, 4, generator=gen)}
    splits = {"model/row": Split(1, 2), "model/qkv": Split(0, 2, parts=3)}
    files: list[list[Piece]] = []
    for tp_rank, dp_rank in itertools.product(range(2), range(dp)):
        pieces = []
        for key, whole in wholes.items():
            split = splits[key]
            part = split.local(whole, tp_rank).reshape(-1)
            per = -(-part.numel() // dp)
            lo, hi = min(dp_rank * per, part.numel()), min((dp_rank + 1) * per, part.numel())
            if lo < hi:
                pieces.append(Piece(key, tuple(whole.shape), whole.dtype, lo, hi, part[lo:hi].clone(),
                                    Strided(*split.strides(tuple(whole.shape), tp_rank))))
        files.append(pieces)
    path = _save(tmp_path, "tp", files)
    reader = ckpt.CheckpointReader(path)
    for key, whole in wholes.items():
        flat = whole.reshape(-1)
        torch.testing.assert_close(reader.full(key), whole, rtol=0, atol=0)
        torch.testing.assert_close(reader.read(key, 5, 29), flat[5:29], rtol=0, atol=0)
        for split in (Split(splits[key].dim, r, splits[key].parts) for r in (1, 2, 4)):
            if whole.shape[split.dim] % (split.parts * split.ranks):
                continue
            for rank in range(split.ranks):
                strided = Strided(*split.strides(tuple(whole.shape), rank))
                part = split.local(whole, rank).reshape(-1)
                torch.testing.assert_close(reader.read(key, 0, part.numel(), strided), part, rtol=0, atol=0)
                torch.testing.assert_close(reader.read(key, 1, part.numel() - 1, strided), part[1:-1], rtol=0, atol=0)
    other = Split(1, 2, parts=2)  # the row weight's columns as two blocks: a stride of 4, not 8
    strided = Strided(*other.strides((6, 8), 1))
    want = other.local(wholes["model/row"], 1).reshape(-1)
    torch.testing.assert_close(reader.read("model/row", 0, 24, strided), want, rtol=0, atol=0)
    out = export(path, tmp_path / "export")
    from safetensors.torch import load_file

    exported = load_file(str(out[0]))
    for key, whole in wholes.items():
        torch.testing.assert_close(exported[key.removeprefix("model/")], whole, rtol=0, atol=0)


def test_a_missing_part_is_named(tmp_path):
    whole = torch.arange(48.0).reshape(6, 8)
    split = Split(1, 2)
    piece = Piece("model/row", (6, 8), whole.dtype, 0, 24, split.local(whole, 0).reshape(-1),
                  Strided(*split.strides((6, 8), 0)))
    reader = ckpt.CheckpointReader(_save(tmp_path, "half", [[piece]]))
    with pytest.raises(ckpt.CheckpointError, match="holds 24 of the 48 elements of 'model/row'"):
        reader.full("model/row")
