"""Per-rank memory of tensor (and sequence) parallelism against Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", measured on the demo GPT.

- Model state: every weight the plan splits is 1/t per rank (parameter, gradient, both Adam moments), the rest
  (norms, biases of row-parallel layers, the position table) is whole; counted from the tensors the rank holds and
  equal to the strategy's own ``memory_report()``.
- Activations (``ActivationMeter`` around one forward of ``training_step``): with sequence parallelism single's / t;
  without it the paper's shape ``sbh(10 + 24/t + 5as/(ht))`` per layer, i.e. A(t) = R + S/t, with R and S derived
  below from what the demo's block saves in fp32, byte for byte.

The ranks are threads of this process computing with real values on the CPU (``SimWorld(device=CPU)``). Not the meta
device: there ``scaled_dot_product_attention`` has no fused kernel and always runs its math decomposition (which
saves the s x s softmax), so meta would measure an attention that neither the CPU nor a GPU runs for this model. On
the CPU both kernels can be pinned with ``sdpa_kernel``, so both are measured: the fused one (``FLASH``: no score
matrix, the paper's 5as/(ht) term gone) and ``MATH`` (the s x s softmax saved, the analogue of that term).

``python -m tests.unit.test_tensor_parallel_memory OUT.md`` writes the measured table.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.simworld import CPU, SimWorld
from trainkit.activation import apply_activation_checkpointing
from trainkit.demo.gpt import DemoGPT
from trainkit_strategies import ActivationMeter, Environment, Precision, get_strategy

V, S, H, A, L, B = 512, 128, 256, 8, 4, 2  # vocabulary, sequence (= block_size), width, heads, blocks, batch
FP32 = 4  # bytes per element: parameters, gradients, Adam moments and activations are all fp32 here
SBH, SB = S * B * H, S * B
FLASH, MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.MATH
SINGLE = None  # ``sp`` of the single-process baseline


def _gpt() -> DemoGPT:
    torch.manual_seed(0)
    gpt = DemoGPT(vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H)  # dropout 0: nn.Dropout saves nothing
    assert gpt.hparams.dropout == 0.0
    return gpt


# -- the demo GPT's shapes -------------------------------------------------------------------------------------------
# Parameters (elements). Split by the plan (trainkit/demo/gpt.py: tensor_parallel_plan): the token table (tied to the
# LM head), per block the fused q/k/v projection (weight and bias, colwise), the attention's output projection
# (weight; rowwise), the MLP's fc (weight and bias; colwise) and its proj (weight; rowwise).
P_SPLIT = V * H + L * ((3 * H * H + 3 * H) + H * H + (4 * H * H + 4 * H) + 4 * H * H)
# Whole on every rank: the position table (block_size x h), per block two LayerNorms (weight and bias) and the biases
# of the two row-parallel layers (added after the reduction), and the final LayerNorm.
P_WHOLE = S * H + L * (2 * 2 * H + H + H) + 2 * H
N_TENSORS = 2 + 12 * L + 2  # parameter tensors (wte, wpe; 12 per block; ln_f's two): one Adam step counter each
SPLIT_NAMES = ("model.wte.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight",
               "mlp.fc.bias", "mlp.proj.weight")


def model_state(t: int) -> dict[str, int]:
    """Bytes a rank holds at tp=t after one AdamW step: 1/t of what the plan splits, all of the rest; AdamW keeps
    two fp32 moments per element and a 0-dim fp32 step counter per parameter tensor."""
    elements = P_SPLIT // t + P_WHOLE
    return {"params": FP32 * elements, "grads": FP32 * elements, "optimizer": 2 * FP32 * elements + FP32 * N_TENSORS}


# Activations (bytes), fp32, no dropout. Per block, without sequence parallelism (Korthikanti et al., §4.1, in fp16
# with 1-byte dropout masks: 34 sbh + 5as^2b, of which 10 sbh stay whole and 24 sbh + 5as^2b split by t):
#   whole, R_BLOCK: ln1's and ln2's inputs (4 + 4 sbh) with their per-row mean and rstd (2 x 2 x 4 sb), the inputs
#     of the two column-parallel layers (qkv's, fc's: the LayerNorm outputs, 4 + 4 sbh) = 16 sbh + 16 sb. The paper
#     has 10 sbh: 8 for the same four tensors at 2 bytes, plus the attention's and the MLP's dropout masks (1 byte,
#     sbh each); the demo has no dropout, so no masks, and the paper neglects the LayerNorms' mean and rstd.
#   split, S_BLOCK: q, k and v (12 sbh: the paper's Q, K 4 sbh + V 2 sbh in fp16), the attention output (4 sbh; it is
#     also the output projection's input: the fused kernel writes it (b, s, a, d)-strided, so the demo's
#     transpose().reshape() is a view and one storage serves both; the paper counts it once, 2 sbh), fc's output
#     (the GELU's input, 16 sbh: paper 8) and the GELU's output (mlp.proj's input, 16 sbh: paper 8) = 48 sbh, the
#     paper's 24 sbh at 4 bytes instead of 2. Beside them the attention's own: FLASH saves its log-sum-exp (4 bytes
#     per row per head: 4abs), MATH the causal softmax (4as^2b); MATH keeps q, k, v as copies (12 sbh) and writes its
#     output contiguous (b, a, s, d), so the output projection saves a reshaped copy (4 sbh): the same 16 sbh for
#     the attention, the same 48 sbh in all. The paper's
#     5as^2b is the softmax (2) + its dropout mask (1) + the dropout's output (2); without dropout only the softmax
#     remains: 4as^2b in fp32 (4as/h sbh), and FLASH saves no s x s matrix at all.
R_BLOCK = 16 * SBH + 16 * SB
S_BLOCK = 48 * SBH
ATTENTION = {FLASH: 4 * A * B * S, MATH: 4 * A * S * S * B}
# Outside the blocks: whole without sequence parallelism are ln_f's input (4 sbh, with mean and rstd) and the LM
# head's input (ln_f's output, 4 sbh); split is the loss's: the vocabulary-parallel cross-entropy keeps the softmax of
# the rank's V/t columns (4sbV/t), single's F.cross_entropy its log-softmax (4sbV). Small and not shrinking (the
# integers): token ids as the embedding looks them up (8 sb, int64), positions (8 s), the targets (8 sb); single's
# nll_loss saves its total weight (fp32 scalar), the tensor-parallel one the mask of tokens outside the rank's rows
# (sb, bool), its loss two masks (2 sb) and the count of targets it divides by (int64 scalar).
R_HEAD = 8 * SBH + 8 * SB
S_HEAD = 4 * SB * V


def small(t: int) -> int:
    return 8 * SB + 8 * S + 8 * SB + (4 if t == 1 else SB + 2 * SB + 8)


def derived_r_s(attention: SDPBackend) -> tuple[int, int]:
    """R and S of A(t) = R + S/t without sequence parallelism (the integers of ``small`` left out)."""
    return L * R_BLOCK + R_HEAD, L * (S_BLOCK + ATTENTION[attention]) + S_HEAD


def derived_activations(t: int, sp: bool | None, attention: SDPBackend) -> int:
    """Bytes one rank saves for backward in one forward: R + S/t (+ the integers); with sequence parallelism R is
    divided by t as well (norms, residuals and the column-parallel layers' saved inputs hold the rank's s/t
    positions: Korthikanti et al., §4.2.2, sbh(34 + 5as/h)/t)."""
    r, s = derived_r_s(attention)
    return (r + s) // t + small(t) if sp else r + s // t + small(t)


def paper_per_layer(t: int, sp: bool | None) -> float:
    """Korthikanti et al. (2022), §4.2.1 (tensor parallelism) and §4.2.2 (with sequence parallelism): bytes per
    layer (fp16 activations, 1-byte dropout masks)."""
    if sp:
        return SBH * (34 + 5 * A * S / H) / t
    return SBH * (10 + 24 / t + 5 * A * S / (H * t))


def ours_per_layer(t: int, sp: bool | None, attention: SDPBackend) -> float:
    """The same per layer in the demo's fp32 constants: sbh(16 + 48/t) + 16sb, plus the attention's own / t."""
    whole, split = R_BLOCK, S_BLOCK + ATTENTION[attention]
    return (whole + split) / t if sp else whole + split / t


# -- measurement ---------------------------------------------------------------------------------------------------
def _nbytes(tensors) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def measure(t: int, sp: bool | None, attention: SDPBackend = FLASH, checkpointing: str | None = None) -> list[dict]:
    """Every rank of tp=t (``sp`` None: the ``single`` strategy): the activations its forward saves, then after
    backward and one AdamW step the bytes of the tensors it holds (per parameter name) and its ``memory_report()``.
    ``checkpointing``: "selective" or "full" recomputation of every block, applied as the Trainer applies it."""
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen))
    world = SimWorld(t, device=CPU)
    models = [_gpt() for _ in range(t)]  # here, not in the rank threads: torch.manual_seed is process-wide
    for model in models if checkpointing else ():
        apply_activation_checkpointing(model, checkpointing)

    def rank(r: int) -> dict:
        strategy = get_strategy("single") if sp is SINGLE else \
            get_strategy("parallel", tp=t, sequence_parallel=sp)
        strategy.setup_environment(Environment(device=CPU, rank=r, local_rank=r, world_size=t), comm=world.comm(r))
        module = models[r]
        strategy.setup(module, module.configure_optimizers()["optimizer"], Precision.from_name("32"))
        with ActivationMeter(exclude=module.parameters()) as meter, strategy.forward_context():
            loss = module.training_step(batch, 0)["loss"]
        strategy.backward(loss)
        strategy.reduce_gradients(1.0)
        strategy.optimizer_step()
        named = dict(module.named_parameters())  # the tied LM head appears once, as model.wte.weight
        name_of = {p: n for n, p in named.items()}
        state = {name_of[p]: _nbytes(v for v in s.values() if torch.is_tensor(v))
                 for p, s in strategy.optimizer.state.items()}
        splits = next(a.splits for a in strategy.axes if a.name == "tp") if t > 1 else {}
        split = {n for n, p in named.items() if p in splits}
        return {"activations": meter.bytes, "split": split,
                "params": {n: _nbytes([p]) for n, p in named.items()},
                "grads": {n: _nbytes([p.grad]) for n, p in named.items()},
                "optimizer": state, "report": dict(strategy.memory_report().device)}

    with sdpa_kernel(attention):  # process-wide flags: the rank threads see them
        return world.run(rank)


CONFIGS = [(1, SINGLE, FLASH), (2, True, FLASH), (4, True, FLASH), (2, False, FLASH), (4, False, FLASH),
           (1, SINGLE, MATH), (2, True, MATH), (4, True, MATH), (2, False, MATH), (4, False, MATH)]


@pytest.fixture(scope="module")
def measured() -> dict:
    out = {}
    for t, sp, attention in CONFIGS:
        ranks = measure(t, sp, attention)
        for r in ranks[1:]:  # every rank holds and saves as much as rank 0 (its own slices)
            assert r == ranks[0], (t, sp, attention)
        out[(t, sp, attention)] = ranks[0]
    return out


def _total(rank: dict, kind: str) -> int:
    return sum(rank[kind].values())


# -- 1. model state ------------------------------------------------------------------------------------------------
def test_shapes_give_the_single_model_state(measured):
    single = measured[(1, SINGLE, FLASH)]
    assert sum(single["params"].values()) == FP32 * (P_SPLIT + P_WHOLE)
    assert len(single["params"]) == N_TENSORS
    assert single["report"] == {"params": FP32 * (P_SPLIT + P_WHOLE), "grads": FP32 * (P_SPLIT + P_WHOLE),
                                "master": 0, "optimizer": model_state(1)["optimizer"], "buffers": 0}


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("t", [2, 4])
def test_model_state_is_one_tth_of_every_split_weight(measured, t, sp):
    single, rank = measured[(1, SINGLE, FLASH)], measured[(t, sp, FLASH)]
    # the strategy split exactly what the plan names (the tied head with the token table)
    assert rank["split"] == {n for n in single["params"] if n.endswith(SPLIT_NAMES)}
    for kind in ("params", "grads", "optimizer"):
        for name, whole in single[kind].items():
            steps = FP32 if kind == "optimizer" else 0  # the step counter is a 0-dim tensor, never split
            expected = (whole - steps) // t + steps if name in rank["split"] else whole
            assert rank[kind][name] == expected, (kind, name, t, rank[kind][name], expected)
    counted = {kind: _total(rank, kind) for kind in ("params", "grads", "optimizer")}
    assert counted == model_state(t), (counted, model_state(t))
    # the strategy's own accounting (storages it holds) agrees with the tensors counted here
    assert rank["report"] == {**model_state(t), "master": 0, "buffers": 0}


# -- 2. activations with sequence parallelism ----------------------------------------------------------------------
@pytest.mark.parametrize("attention", [FLASH, MATH], ids=["flash", "math"])
@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_activations_are_single_over_t(measured, t, attention):
    single = measured[(1, SINGLE, attention)]["activations"]
    rank = measured[(t, True, attention)]["activations"]
    assert abs(rank - single / t) <= 0.10 * single / t, (t, rank, single / t, rank / single)
    # tighter, from the shapes: everything but a few integer tensors divided by t (column-parallel layers saving
    # their gathered inputs instead of the rank's slices would add 4 sbh x (t - 1)/t for each of the 2L + 1 of
    # them: 13% at t = 2, 40% at t = 4)
    assert abs(rank - single / t) <= 0.01 * single / t, (t, rank, single / t, rank / single)


# -- 3. activations without it: A(t) = R + S/t -----------------------------------------------------------------------
@pytest.mark.parametrize("attention", [FLASH, MATH], ids=["flash", "math"])
def test_activations_without_sequence_parallelism_are_r_plus_s_over_t(measured, attention):
    a1, a2, a4 = (measured[k]["activations"] for k in [(1, SINGLE, attention), (2, False, attention),
                                                        (4, False, attention)])
    assert abs((a1 - a2) - 2 * (a2 - a4)) <= 0.02 * (a1 - a2), (a1, a2, a4)  # the shape R + S/t
    r_fit, s_fit = 2 * a2 - a1, 2 * (a1 - a2)
    r, s = derived_r_s(attention)
    # the derivation leaves out only integer tensors (ids, targets, masks: 0.14% of R here)
    assert abs(r_fit - r) <= 0.01 * r, ("R", r_fit / SBH, r / SBH)
    assert abs(s_fit - s) <= 0.01 * s, ("S", s_fit / SBH, s / SBH)
    assert a2 > 1.2 * measured[(2, True, attention)]["activations"]  # what sequence parallelism removes: R/2


def test_attention_kernels_differ_by_the_score_matrix(measured):
    """The paper's 5as/(ht) term: MATH saves a's s x s softmax (divided by t with the heads), FLASH none."""
    for t, sp in [(1, SINGLE), (2, False), (4, False), (2, True), (4, True)]:
        extra = measured[(t, sp, MATH)]["activations"] - measured[(t, sp, FLASH)]["activations"]
        assert extra == L * (ATTENTION[MATH] - ATTENTION[FLASH]) // t, (t, sp, extra)


@pytest.mark.parametrize(("t", "sp", "attention"), CONFIGS,
                         ids=[f"tp{t}-{'single' if sp is SINGLE else 'sp' if sp else 'nosp'}-"
                              f"{'flash' if a is FLASH else 'math'}" for t, sp, a in CONFIGS])
def test_activations_match_the_derivation_byte_for_byte(measured, t, sp, attention):
    """Every tensor the derivation above names, and nothing else (tied to torch's kernels: what LayerNorm,
    the attention kernels and cross-entropy save)."""
    assert measured[(t, sp, attention)]["activations"] == derived_activations(t, sp, attention)


# -- 4. selective checkpointing under tensor parallelism ------------------------------------------------------------
# Selective recomputation keeps a block's input (the checkpoint's, 4 sbh whole, or 4 sbh/t under sequence
# parallelism), the outputs of its matmuls and of the fused attention: q/k/v (12 sbh/t), the attention's output and
# log-sum-exp (4 sbh/t + the same 4abs/t as without checkpointing), fc's (16 sbh/t); 44 sbh + lse per block at t = 1,
# where the two output projections' products (4 sbh each) are kept too. Under tensor parallelism those two are a
# row-parallel layer's partial sums, 4 sbh on every rank whatever t is and read by nothing once reduced: they are
# recomputed instead (kept, selective would hold more than no checkpointing from t = 4 with sequence parallelism).
# What selective saves less than none per block (the LayerNorms' inputs, outputs, mean and rstd, the GELU's output):
#   t = 1:           20 sbh + 16 sb
#   with sp:        (28 sbh + 16 sb) / t
#   without sp:      12 sbh + 16 sb + 16 sbh / t  (the norms are whole, the checkpoint's input too)
def selective_saving(t: int, sp: bool | None) -> int:
    if sp is SINGLE:
        return L * (20 * SBH + 16 * SB)
    return L * (28 * SBH + 16 * SB) // t if sp else L * (12 * SBH + 16 * SB + 16 * SBH // t)


CHECKPOINTED = [(1, SINGLE), (2, True), (4, True), (2, False), (4, False)]


@pytest.fixture(scope="module")
def checkpointed() -> dict:
    out = {}
    for mode in ("selective", "full"):
        for t, sp in CHECKPOINTED:
            ranks = measure(t, sp, FLASH, mode)
            assert all(r["activations"] == ranks[0]["activations"] for r in ranks)
            out[(t, sp, mode)] = ranks[0]["activations"]
    return out


@pytest.mark.parametrize(("t", "sp"), CHECKPOINTED, ids=["single", "tp2-sp", "tp4-sp", "tp2-nosp", "tp4-nosp"])
def test_selective_checkpointing_under_tensor_parallelism(measured, checkpointed, t, sp):
    none, selective, full = measured[(t, sp, FLASH)]["activations"], checkpointed[(t, sp, "selective")], \
        checkpointed[(t, sp, "full")]
    assert full < selective < none, (t, sp, full, selective, none)
    assert none - selective == selective_saving(t, sp), (t, sp, (none - selective) / SBH)
    if sp:  # with sequence parallelism everything selective keeps is divided by t, as none's is
        assert selective < checkpointed[(1, SINGLE, "selective")] / t


# -- the table -------------------------------------------------------------------------------------------------------
def table(results: dict) -> str:
    mb = lambda n: f"{n / 1e6:.3f}"
    sbh = lambda n: f"{n / SBH:.2f}"
    lines = [
        f"Demo GPT (`trainkit/demo/gpt.py`), fp32, per rank: L = {L} blocks, h = {H}, a = {A} heads, s = {S}, "
        f"b = {B}, vocabulary V = {V}, no dropout (sbh = {SBH:,} elements; as/h = {A * S // H}). Tensor-parallel "
        "ranks are threads of one process computing with real values on the CPU (`tests/simworld.py`). Model state: "
        "bytes of the parameters, gradients and AdamW state (two moments + step counters) the rank holds after one "
        "step, counted from the tensors (equal to `memory_report()`). Activations: bytes autograd saves for backward "
        "in one forward of `training_step` (`ActivationMeter`, parameters excluded), with "
        "`scaled_dot_product_attention` pinned to the fused kernel (flash: what runs on CPU and GPU for this model) "
        "or to the math one (which saves the s x s softmax). Derived: the byte count from the model's shapes "
        "(`derived_activations` in `tests/unit/test_tensor_parallel_memory.py`; equal to the measurement to the "
        "byte). Paper: Korthikanti et al. (2022) per layer x L (transformer blocks only), in its units (fp16 "
        "activations, 1-byte dropout masks: sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34 + 5as/h)/t) "
        "and in the demo's fp32 constants (sbh(16 + 48/t) + 16sb, plus 4abs/t for flash or sbh x 4as/(ht) for math; "
        "all / t with sequence parallelism). MB = 10^6 bytes.",
        "",
        "| tp | seq. parallel | params MB | grads MB | AdamW MB | model state / single's | attention "
        "| activations MB | / single's | derived MB | paper x L, fp16 MB | paper x L, our fp32 constants MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for attention in (FLASH, MATH):
        one = results[(1, SINGLE, attention)]
        state1 = sum(one["report"][k] for k in ("params", "grads", "optimizer"))
        for t, sp in [(1, SINGLE), (2, True), (4, True), (2, False), (4, False)]:
            got = results[(t, sp, attention)]
            state = [_total(got, k) for k in ("params", "grads", "optimizer")]
            act = got["activations"]
            lines.append(
                f"| {t} | {'(single)' if sp is SINGLE else 'yes' if sp else 'no'} | {mb(state[0])} | {mb(state[1])} "
                f"| {mb(state[2])} | {sum(state) / state1:.3f} | {'flash' if attention is FLASH else 'math'} "
                f"| {mb(act)} | {act / one['activations']:.3f} | {mb(derived_activations(t, sp, attention))} "
                f"| {mb(L * paper_per_layer(t, sp))} | {mb(L * ours_per_layer(t, sp, attention))} |")
    lines += ["", "Without sequence parallelism, A(t) = R + S/t fitted to t = 1, 2, 4 (R = 2A(2) - A(1), "
              "S = 2(A(1) - A(2))), in bytes per sbh:", "",
              "| attention | (A1 - A2) / 2(A2 - A4) | R measured | R derived | S measured | S derived "
              "| paper x L: R, S (fp16) |", "|---|---|---|---|---|---|---|"]
    for attention in (FLASH, MATH):
        a1, a2, a4 = (results[k]["activations"] for k in [(1, SINGLE, attention), (2, False, attention),
                                                           (4, False, attention)])
        r, s = derived_r_s(attention)
        lines.append(f"| {'flash' if attention is FLASH else 'math'} | {(a1 - a2) / (2 * (a2 - a4)):.4f} "
                     f"| {sbh(2 * a2 - a1)} | {sbh(r)} | {sbh(2 * (a1 - a2))} | {sbh(s)} "
                     f"| {L * 10}, {L * (24 + 5 * A * S // H)} |")
    lines += [
        "",
        f"Model state: the plan splits P_split = Vh + L(12h^2 + 7h) = {P_SPLIT:,} parameters (token table tied to "
        f"the head, q/k/v, attention output, MLP fc and proj) and leaves P_whole = sh + 6Lh + 2h = {P_WHOLE:,} whole "
        "(position table, LayerNorms, the row-parallel layers' biases): per rank 4(P_split/t + P_whole) bytes of "
        f"parameters, as many of gradients, 8(P_split/t + P_whole) + 4 x {N_TENSORS} (step counters) of AdamW state.",
        "",
        "How our constants differ from the paper's. Per layer the paper's sbh(10 + 24/t + 5as/(ht)) bytes are "
        "sbh(16 + 48/t) + 16sb in the demo's fp32, plus the attention kernel's own. The part split by t doubles, "
        "24 -> 48: q, k, v (12), the attention output, which is also the output projection's input (4), the MLP's "
        "4h GELU input (16) and output (16), at 4 bytes an element instead of 2. The whole part is 16, not 10: the "
        "two LayerNorm inputs and the inputs of the two column-parallel layers (the LayerNorm outputs) cost 4 bytes "
        "each instead of 2 (8 -> 16), and the paper's two 1-byte dropout masks (2) are absent: the demo has no "
        "dropout (the +16sb are the LayerNorms' per-row mean and rstd, which the paper neglects). The paper's "
        "5as/(ht) is the softmax (2 bytes) + its dropout mask (1) + the dropout's output (2); without dropout only "
        "the softmax remains, 4as/(ht) sbh in fp32, and only with the math kernel (which in exchange keeps q, k, v "
        "and the output as copies: the same 16 sbh). The fused kernel keeps no s x s matrix at all, just a per-row "
        "log-sum-exp (4a/h sbh / t). With sequence parallelism every term is divided by t (the paper's "
        "sbh(34 + 5as/h)/t; ours sbh(64 [+ 4as/h])/t), so the whole model's activations are single's / t but for a "
        "few integer tensors (token ids, targets, masks: < 0.1% here). Outside the blocks, R also holds the final "
        "LayerNorm's input and the LM head's input (8 sbh) and S the vocabulary-parallel loss's softmax (4V/h sbh "
        "over the rank's V/t columns).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    results = {}
    for config in CONFIGS:
        results[config] = measure(*config)[0]
        assert results[config]["activations"] == derived_activations(*config), config
    text = table(results)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    print(text)
