"""Memory under tensor parallelism against Korthikanti et al. (2022), measured per rank on the CPU: model state 1/tp
of every split weight (whole for what the plan leaves replicated), activations single's / tp with sequence
parallelism, and without it the paper's shape sbh(10 + 24/t + 5as/(ht)): a part that does not shrink with t and one
that does. Ranks are threads of this process moving real values (``tests/simworld.py``); docs/parallel.md has the
table."""

from __future__ import annotations

import pytest
import torch

from tests.simworld import CPU, SimWorld
from trainkit.demo.gpt import DemoGPT
from trainkit_strategies import ActivationMeter, Environment, Precision, get_strategy

V, S, H, A, L, B = 512, 128, 256, 8, 4, 2  # vocabulary, sequence, width, heads, blocks, batch


def _gpt() -> DemoGPT:
    torch.manual_seed(0)
    return DemoGPT(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H)


def _measure(t: int, sequence_parallel: bool | None) -> dict:
    """Rank 0's activations of one forward, and the bytes of the tensors it holds after one AdamW step (counted
    from the tensors themselves) beside its ``memory_report()``; ``sequence_parallel`` None: ``single``."""
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen))
    world = SimWorld(t, device=CPU)
    models = [_gpt() for _ in range(t)]

    def rank(r: int) -> dict:
        strategy = get_strategy("single") if sequence_parallel is None else \
            get_strategy("parallel", tp=t, sequence_parallel=sequence_parallel)
        strategy.setup_environment(Environment(rank=r, world_size=t), comm=world.comm(r))
        module = models[r]
        strategy.setup(module, module.configure_optimizers()["optimizer"], Precision.from_name("32"))
        with ActivationMeter(exclude=module.parameters()) as meter, strategy.forward_context():
            loss = module.training_step(batch, 0)["loss"]
        strategy.backward(loss)
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
        params = list(module.parameters())
        state = [v for s in strategy.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        nbytes = lambda ts: sum(x.numel() * x.element_size() for x in ts)
        return {"activations": meter.bytes, "params": nbytes(params), "grads": nbytes(p.grad for p in params),
                "optimizer": nbytes(state), "report": dict(strategy.memory_report().device)}

    return world.run(rank)[0]


@pytest.fixture(scope="module")
def measured() -> dict:
    return {(t, sp): _measure(t, sp) for t, sp in [(1, None), (2, True), (4, True), (2, False), (4, False)]}


def _split_and_whole() -> tuple[int, int]:
    """Bytes of the parameters the demo GPT's plan splits, and of those it leaves whole, from its shapes."""
    module = _gpt()
    split_names = ("wte", "qkv", "attn.proj", "mlp.fc", "mlp.proj")
    split = whole = 0
    for name, p in module.named_parameters():
        is_split = any(k in name for k in split_names) and not name.endswith("proj.bias")  # row-parallel bias: whole
        if is_split:
            split += p.numel() * 4
        else:
            whole += p.numel() * 4
    return split, whole


@pytest.mark.parametrize("t", [2, 4])
def test_model_state_is_one_tp_th_of_every_split_weight(measured, t):
    split, whole = _split_and_whole()
    single = measured[(1, None)]
    assert single["params"] == split + whole
    for sp in (True, False):
        rank = measured[(t, sp)]
        assert rank["params"] == split // t + whole, (t, sp, rank["params"], split // t + whole)
        assert rank["grads"] == rank["params"]
        assert rank["optimizer"] == 2 * rank["params"]  # Adam's two moments
        # the strategy's own accounting agrees with the tensors counted here
        report = rank["report"]
        assert (report["params"], report["grads"]) == (rank["params"], rank["grads"])
        assert report["optimizer"] >= rank["optimizer"]  # (plus the step counters)


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_activations_are_single_over_tp(measured, t):
    single = measured[(1, None)]["activations"]
    rank = measured[(t, True)]["activations"]
    assert abs(rank - single / t) <= 0.10 * single / t, (t, rank, single / t)


def test_activations_without_sequence_parallelism_follow_the_papers_shape(measured):
    """A(t) = R + S/t: R the whole activations every rank keeps (the two LayerNorm inputs and the two inputs of the
    column-parallel layers of each block, 16 sbh bytes in fp32, the paper's 10 sbh at 2 bytes with dropout masks,
    plus the final norm's input), S what tp divides (the paper's 24 sbh: 12 activations per element, 48 bytes in
    fp32; no 5as/h term: scaled_dot_product_attention keeps no score matrix)."""
    a1, a2, a4 = (measured[k]["activations"] for k in [(1, None), (2, False), (4, False)])
    assert abs((a1 - a2) - 2 * (a2 - a4)) <= 0.03 * (a1 - a2), (a1, a2, a4)
    shrinking = 2 * (a1 - a2)
    whole = a1 - shrinking
    sbh = S * B * H
    assert abs(whole - (L * 16 + 4) * sbh) <= 0.10 * whole, (whole, (L * 16 + 4) * sbh)
    assert abs(shrinking - L * 48 * sbh) <= 0.10 * shrinking, (shrinking, L * 48 * sbh)
    assert a2 > 1.2 * measured[(2, True)]["activations"]  # sequence parallelism is what removes R / t
