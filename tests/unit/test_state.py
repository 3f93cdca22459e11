"""Universal state pieces: any flat sharding of params and optimizer state reloads into any other."""

from __future__ import annotations

import torch
from torch import nn

from trainkit_strategies.state import pieces as st


class DictReader:
    """A Reader over pieces held in memory (what a checkpoint directory gives, without files)."""

    def __init__(self, pieces: list[st.Piece]) -> None:
        self.pieces = pieces

    def info(self, key):
        for p in self.pieces:
            if p.key == key:
                return p.shape, p.dtype
        return None

    def keys(self):
        return {p.key for p in self.pieces}

    def read(self, key, start, stop, strided=None):
        """Element by element, through each side's flat index of the whole (independent of ``state.overlaps``)."""
        def index(s, u):
            return s.index(u) if s is not None else u

        out = torch.empty(stop - start, dtype=self.info(key)[1])
        wanted = {index(strided, u): u - start for u in range(start, stop)}
        for p in self.pieces:
            if p.key == key:
                for u in range(p.start, p.stop):
                    at = wanted.get(index(p.strided, u))
                    if at is not None:
                        out[at] = p.data[u - p.start]
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))


def _trained_optimizer(model: nn.Module) -> torch.optim.AdamW:
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight], "weight_decay": 0.1},
                             {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}], lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
    return opt


def _whole_layout(model: nn.Module, opt) -> st.StateLayout:
    names = st.param_names(model)
    shapes = {n: tuple(p.shape) for p, n in names.items()}
    model_h = [st.whole_holder(n, p, True) for p, n in names.items()]
    opt_h = [st.whole_holder(names[p], p, True) for g in opt.param_groups for p in g["params"]]
    return st.StateLayout(shapes, model_h, opt, opt_h, st.group_names_of(opt, names))


def _sharded_layouts(model: nn.Module, world: int) -> list[tuple[list[st.Holder], torch.Tensor]]:
    """Every parameter flattened into one buffer split in ``world`` equal (padded) slices."""
    names = list(st.param_names(model).values())
    sizes = [p.numel() for p in model.parameters()]
    total = sum(sizes)
    per = -(-total // world)
    out = []
    for r in range(world):
        lo, hi = r * per, min((r + 1) * per, total)
        segs, offset = [], 0
        for name, size in zip(names, sizes, strict=True):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                segs.append(st.Segment(name, a - offset, b - offset, a - lo))
            offset += size
        out.append((segs, torch.zeros(per)))
    return out


def test_whole_state_round_trips_through_a_sharded_layout_and_back():
    model = _model()
    opt = _trained_optimizer(model)
    pieces = st.collect_pieces(_whole_layout(model, opt))
    reader = DictReader(pieces)
    flat_expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    exp_avg_expected = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])

    resharded = []
    for segs, buf in _sharded_layouts(model, 3):
        holder = st.Holder(buf, tuple(segs), True)
        shard = nn.Parameter(buf)
        shard_opt = torch.optim.AdamW([shard], lr=0.5)
        layout = st.StateLayout({n: tuple(p.shape) for n, p in model.named_parameters()}, [holder], shard_opt,
                                [holder], [[s.name for s in segs]])
        st.load_model(layout, reader)
        flat_state = torch.zeros_like(buf)
        for s in segs:
            flat_state[s.offset : s.offset + s.stop - s.start] = reader.read(f"optim/{s.name}/exp_avg", s.start, s.stop)
        layout.group_names = [[s.name for s in segs]]
        resharded.append((layout, holder, shard_opt, flat_state))
    got = torch.cat([h.tensor for _, h, _, _ in resharded])[: flat_expected.numel()]
    assert torch.equal(got, flat_expected)
    got_state = torch.cat([fs for *_, fs in resharded])[: flat_expected.numel()]
    assert torch.equal(got_state, exp_avg_expected)

    sharded_pieces = [p for layout, *_ in resharded for p in st.collect_pieces(layout)]
    back = _model()
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    back_opt = torch.optim.AdamW([{"params": [back[0].weight, back[1].weight], "weight_decay": 0.0},
                                  {"params": [back[0].bias, back[1].bias], "weight_decay": 0.0}], lr=0.0)
    layout = _whole_layout(back, back_opt)
    st.load_model(layout, DictReader(sharded_pieces))
    for p, q in zip(back.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_optimizer_state_and_group_hyperparameters_restore():
    model = _model()
    opt = _trained_optimizer(model)
    layout = _whole_layout(model, opt)
    reader = DictReader(st.collect_pieces(layout))
    hyper = st.group_hyperparameters(opt)
    groups = [{"params": names, **h} for names, h in zip(layout.group_names, hyper, strict=True)]

    fresh = _model()
    fresh_opt = torch.optim.AdamW([{"params": [fresh[0].weight, fresh[1].weight], "weight_decay": 0.5},
                                   {"params": [fresh[0].bias, fresh[1].bias], "weight_decay": 0.5}], lr=1.0)
    fresh_layout = _whole_layout(fresh, fresh_opt)
    st.load_model(fresh_layout, reader)
    st.load_optimizer(fresh_layout, reader, groups)
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.1, 0.0]
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert isinstance(fresh_opt.param_groups[0]["betas"], tuple)
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_opt.state[p][key], opt.state[q][key]), key
    x = torch.randn(4, 5)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_mismatched_model_is_named():
    model = _model()
    reader = DictReader(st.collect_pieces(_whole_layout(model, _trained_optimizer(model))))
    other = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2))
    layout = _whole_layout(other, torch.optim.SGD(other.parameters(), lr=0.1))
    try:
        st.load_model(layout, reader)
    except ValueError as err:
        assert "0.weight: checkpoint shape (3, 5), model shape (4, 5)" in str(err)
    else:
        raise AssertionError("expected ValueError")
