"""trainkit.moe.MoE on one process against references written out token by token: dropless routing (softmax and
sigmoid scores, shared experts) in values and gradients, grouped_mm against the loop, capacity routing keeping the
assignments GShard's priority keeps, the balance and z-losses against their formulas, and the step adding them to
the objective."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.parity.plain import moe_losses_by_formula
from trainkit import Trainer, TrainModule
from trainkit.callbacks import Callback
from trainkit.moe import MoE, moe_metrics
from trainkit_strategies.experts import dispatch
from trainkit_strategies.experts.auxiliary import collecting


def _moe(**options) -> MoE:
    torch.manual_seed(0)
    layer = MoE(8, 12, 6, **options)
    nn.init.normal_(layer.router.weight, std=0.5)
    return layer


def _reference(layer: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its top k experts, one at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.t()
    scores = logits.softmax(-1) if layer.scoring == "softmax" else logits.sigmoid()
    top, chosen = scores.topk(layer.top_k, -1)
    weights = top / top.sum(-1, keepdim=True) if layer.normalize else top
    rows = []
    for t in range(tokens.shape[0]):
        out = torch.zeros(x.shape[-1])
        for j in range(layer.top_k):
            if keep is not None and not keep[t, j]:
                continue
            e = chosen[t, j]
            hidden = F.silu(tokens[t] @ layer.w1[e]) * (tokens[t] @ layer.w3[e])
            out = out + weights[t, j] * (hidden @ layer.w2[e])
        if layer.shared is not None:
            out = out + layer.shared(tokens[t])
        rows.append(out)
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("options", [{}, {"scoring": "sigmoid"}, {"normalize": False, "top_k": 3},
                                     {"shared_hidden": 5}], ids=["softmax", "sigmoid", "top3-raw", "shared"])
def test_dropless_routing_equals_the_token_by_token_reference(options):
    layer = _moe(**options)
    x = torch.randn(3, 7, 8, requires_grad=True)
    got, want = layer(x), _reference(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(got)
    wrt = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(got, wrt, grad), torch.autograd.grad(want, wrt, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert int(layer.tokens_per_expert.sum()) == 21 * layer.top_k and float(layer.dropped) == 0.0


def test_grouped_mm_and_the_loop_over_experts_agree(monkeypatch):
    layer = _moe()
    x = torch.randn(4, 9, 8, requires_grad=True)
    grouped = layer(x)
    g_grouped = torch.autograd.grad(grouped.square().sum(), [x, layer.w1, layer.w2])
    monkeypatch.delattr(F, "grouped_mm")
    looped = layer(x)
    g_looped = torch.autograd.grad(looped.square().sum(), [x, layer.w1, layer.w2])
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_grouped, g_looped, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not dispatch.grouped_mm_fallback()  # grouped_mm ran on this CPU: the first call did not fall back


def test_capacity_routing_keeps_gshards_priority_and_counts_the_drops():
    layer = _moe(capacity_factor=0.5)
    x = torch.randn(2, 12, 8)
    tokens = x.reshape(-1, 8)
    chosen = layer.router(tokens).softmax(-1).topk(2, -1).indices
    capacity = math.ceil(0.5 * 24 * 2 / 6)
    keep, taken = torch.zeros_like(chosen, dtype=torch.bool), [0] * 6
    for j in range(2):  # every token's first choice before any second one, tokens in order
        for t in range(24):
            e = int(chosen[t, j])
            if taken[e] < capacity:
                keep[t, j], taken[e] = True, taken[e] + 1
    assert not keep.all()  # this capacity drops some
    torch.testing.assert_close(layer(x), _reference(layer, x, keep), rtol=1e-5, atol=1e-6)
    assert layer.tokens_per_expert.tolist() == taken
    assert float(layer.dropped) == pytest.approx(1 - keep.sum().item() / keep.numel())
    roomy = _moe(capacity_factor=6.0)  # room for every assignment: dropless
    torch.testing.assert_close(roomy(x), _reference(roomy, x), rtol=1e-5, atol=1e-6)
    assert float(roomy.dropped) == 0.0


def test_the_balance_and_z_losses_follow_their_formulas():
    layer = _moe(top_k=2)
    x = torch.randn(3, 10, 8)
    with collecting(layer) as found:
        layer(x)
    balance, z = (float(t) for t in moe_losses_by_formula(layer, x))
    assert float(layer.balance) == pytest.approx(balance, rel=1e-6)
    assert float(layer.z) == pytest.approx(z, rel=1e-6)
    assert len(found) == 1 and float(found[0][0]) == pytest.approx(0.01 * float(layer.balance), rel=1e-6)
    assert found[0][1] == 3 * 10  # the tokens the term is a mean over
    flat = _moe(top_k=2)
    nn.init.zeros_(flat.router.weight)  # every expert equally likely: balanced by the formula's measure
    flat(x)
    assert float(flat.balance) == pytest.approx(1.0) and float(flat.z) == pytest.approx(math.log(6) ** 2)


def test_the_sequence_balance_of_a_batch_is_the_mean_of_its_parts():
    """Per sequence, averaged: a batch split across ranks or micro-batches gives the same loss in its parts."""
    layer = _moe()
    x = torch.randn(4, 10, 8)
    layer(x)
    whole = float(layer.balance)
    halves = []
    for part in x.split(2):
        layer(part)
        halves.append(float(layer.balance))
    assert whole == pytest.approx(sum(halves) / 2, rel=1e-6)


class _TinyMoE(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.moe = MoE(8, 12, 4, balance_coef=0.5, z_coef=0.1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.moe(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log_dict(moe_metrics(self))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_step_adds_the_auxiliary_losses_to_the_objective(tmp_path):
    data = [(torch.randint(0, 10, (4, 6)), torch.randint(0, 10, (4, 6)))]
    seen: dict[str, torch.Tensor] = {}

    class Grads(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen.update({n: p.grad.clone() for n, p in module.named_parameters()})

    module = _TinyMoE()
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=tmp_path, callbacks=[Grads()])
    trainer.fit(module, data)
    reference = _TinyMoE()
    x, y = data[0]
    loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
    balance, z = moe_losses_by_formula(reference.moe, reference.embed(x))
    (loss + 0.5 * balance + 0.1 * z).backward()  # the objective written out
    for name, p in reference.named_parameters():
        torch.testing.assert_close(seen[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert float(trainer.callback_metrics["moe/dropped"]) == 0.0
    assert float(sum(trainer.callback_metrics[f"moe/tokens/expert{e}"] for e in range(4))) == 4 * 6 * 2


def test_a_moe_layer_plans_on_the_meta_device():
    with torch.device("meta"):
        layer = MoE(8, 12, 6, capacity_factor=1.0)
    x = torch.empty(2, 5, 8, device="meta", requires_grad=True)
    layer(x).sum().backward()
    assert layer.w1.grad.shape == (6, 8, 12)
