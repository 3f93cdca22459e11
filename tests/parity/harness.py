"""Parity harness: run a strategy at world size W on a global batch, compare with one process.

``run_world(world_size, cases)`` starts W gloo ranks on 127.0.0.1 (one thread each, a free port, a
timeout) that join one process group and run every case through ``Trainer.fit`` in turn, so process
start-up is paid once per world size (and imports once per session: ``start_method``). Each rank reads
its shard of the same global batches (the trainer's sampler strides one permutation), records the global
loss of every optimizer step, the full reduced gradients before every step and the final parameters;
rank 0 writes them out. ``run_reference(case, world_size)`` trains the same case with the ``single``
strategy on the whole global batch in this process. Tests compare the two with ``assert_close``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from tests.helpers import (
    BatchNormRegression,
    DeferredInitNet,
    LeakyGenerator,
    LossValidatedRegression,
    MaskedRegression,
    MaskedSequences,
    Regression,
    RoutedItemsRegression,
    RoutedRegression,
    ValidatedRegression,
    accelerator_for,
    regression_data,
    sequence_regression_data,
)
from tests.parity.plain import train_plain
from trainkit import Trainer
from trainkit.callbacks import Callback
from trainkit.demo.gpt import Block, DemoGPT
from trainkit.demo.markov import MarkovChain, TokenWindows
from trainkit.optim import OneBitAdam
from trainkit.utils import infer_batch_size
from trainkit_strategies import RunsSchedule, StepsInBackward, capability, get_strategy
from trainkit_strategies.offload import native

FP32 = {"rtol": 1e-5, "atol": 1e-6}
SPREAD = 8.0  # a low-precision result may differ from its reference by this many times the rounding spread
# the plain loop's legitimate variants (tests/parity/plain.py): each micro-batch in pieces (how reductions
# re-associate), and the mixed policies' forward on low-precision working copies of the parameters (ZeRO's, FSDP's)
LEGITIMATE = ((None, 2), (None, 4), ("working", 1), ("working", 2))  # and the case's own split (its replicas)


@dataclass
class Tolerance:
    """Absolute tolerances derived from a low-precision run (``derive_tolerance``), on top of fp32's ``FP32``: one per
    step for the loss and one per step for the gradients (the first step's own, tight: the same forward summed in
    another order; every later step the largest of them all), one for the final parameters and one for the
    metrics."""

    losses: list[float]
    grads: list[float]
    params: float
    val: float


@dataclass(frozen=True)
class Case:
    """One parity run: strategy and options, precision, accumulation, clipping, model and sizes."""

    name: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    precision: str = "32"
    accumulate: int = 1
    clip: float | None = None
    clip_algorithm: str = "norm"  # or "value"
    steps: int = 10
    per_rank_batch: int = 4
    # "regression", "validated" (sync_dist and torchmetrics validation), "masked" (num_items),
    # "routed" (parameters unused at times; "routed_items": and num_items), "gpt" (tied embeddings, tokens as
    # items; "gpt6": 6 blocks), "batchnorm" (BatchNorm statistics, compared across strategies: a single process
    # normalises over the global batch),
    # "leaky" (BatchNorm and LeakyReLU(inplace=True) after every Linear: Lightning's GAN generator),
    # "loss_validated" (no pipeline_validation_step: pipeline validates with pipeline_loss), "deferred" (built
    # and custom-initialised in configure_model: on the meta device under zero3/fsdp)
    model: str = "regression"
    record_comm: bool = False
    validate: bool = False  # validate every 5 steps on 13 samples (uneven across ranks): val_* metrics
    checkpointing: bool | str = False  # activation checkpointing on the GPT's blocks (True: full) or a mode by name
    init_scale: float | None = None  # "16-mixed": start the loss scale here (low enough that nothing overflows)
    onebit: dict[str, Any] | None = None  # train with trainkit.optim.OneBitAdam(**onebit) instead of AdamW
    samples_per_replica: int | None = None  # the data's size per replica (default: full windows of ``steps``)
    compile: bool = False  # Trainer(compile=True): the blocks compiled (inductor); the reference stays eager
    probe_grads: bool = True  # read full gradients before every step (False: no hook needs them, and a strategy
    # that can step during backward does: zero_offload's overlapped host step)
    sends_twice: bool = False  # a guard: every reduce-scatter and all-gather is sent a second time (on copies)
    watch_saved: bool = False  # measure the bytes autograd holds for backward (HeldActivations): peaks' "held"
    reduce_dtype: str | None = None  # the precision policy's: what gradients are summed across ranks in

    def replicas(self, world_size: int) -> int:
        """Data-parallel replicas: the ranks of one pipeline, of one tensor-parallel and of one context-parallel group
        read the same data."""
        if self.strategy == "pipeline":
            return world_size // self.options.get("stages", world_size)
        if self.strategy == "parallel":
            return world_size // (self.options.get("tp", 1) * self.options.get("pp", 1) * self.options.get("cp", 1))
        return world_size

    def tolerance(self) -> dict[str, float]:
        """fp32's; a low-precision case is held to the tolerance derived with its reference (``run_reference``)."""
        return FP32


@dataclass
class Result:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    comm: list[dict[str, int]] = field(default_factory=list)  # bytes per micro-step, by collective kind
    psi: int = 0
    val: dict[str, float] = field(default_factory=dict)  # val_* metrics; buffer_spread: ranks' largest disagreement
    peaks: list[dict] = field(default_factory=list)  # pipeline: each rank's activation peak in the last step
    steps_in_backward: int = 0  # optimizer steps the strategy took during backward (zero_offload)
    host_fallback: str = ""  # why the offloaded host step ran torch's kernels instead of the compiled one, if it did
    graphs: list[int] = field(default_factory=list)  # compile: graphs compiled by the end of step 1, and by the end
    tolerance: Tolerance | None = None  # a low-precision reference's, derived from its run


class Probe(Callback):
    """Global window loss (all ranks, all micro-batches, weighted by items), full grads, comm bytes."""

    def __init__(self, record_comm: bool, init_scale: float | None = None, sends_twice: bool = False) -> None:
        self.record_comm, self.init_scale, self.sends_twice = record_comm, init_scale, sends_twice
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.comm: list[dict[str, int]] = []
        self._sum = torch.zeros(2, dtype=torch.float64)
        self._step = 0
        self._bytes: dict[str, int] = {}
        self.graphs_after_first_step: list[int] = []

    def on_train_start(self, trainer, module) -> None:
        if self.sends_twice:
            _send_twice(trainer.strategy.comm)
        self._bytes = dict(trainer.strategy.comm.stats.bytes)
        if self.init_scale is not None:
            trainer.scaler.scale = self.init_scale

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1 and not self.graphs_after_first_step:
            self.graphs_after_first_step = [compiled_graphs()]
        if self.record_comm:
            now = dict(trainer.strategy.comm.stats.bytes)
            delta = {k: now[k] - self._bytes.get(k, 0) for k in now}
            self.comm.append({k: v for k, v in delta.items() if v})
            self._bytes = now
            return
        # a plain mean loss averages its batch's samples: the window's loss weighs it by them
        loss, n = (outputs["loss"], outputs["num_items"]) if isinstance(outputs, dict) else \
            (outputs, infer_batch_size(batch))
        self._sum += torch.tensor([float(loss.detach()) * float(n), float(n)], dtype=torch.float64)
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            total = trainer.strategy.reduce(self._sum, "sum")
            self.losses.append(float(total[0] / total[1]))
            self._sum.zero_()

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if not self.record_comm:
            grads = trainer.strategy.full_gradients()
            self.grads.append({k: v.detach().to("cpu", torch.float32, copy=True) for k, v in grads.items()})


def _send_twice(comm: Any) -> None:
    """Make ``comm`` send every reduce-scatter and all-gather twice: first on copies, then for real (the guard of
    the communication tests: a strategy that sends twice must fail them)."""
    for kind in ("reduce_scatter", "all_gather"):
        real = getattr(comm, kind)

        def twice(output: torch.Tensor, input: torch.Tensor, *args: Any, real: Any = real, **kwargs: Any) -> Any:
            real(torch.empty_like(output), input.clone(), *args, **{**kwargs, "async_op": False})
            return real(output, input, *args, **kwargs)

        setattr(comm, kind, twice)


class _Held:
    """What a saved tensor is packed into: autograd drops it when it frees the saved tensor."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in _tensors(b)]
    if isinstance(batch, dict):
        return [t for b in batch.values() for t in _tensors(b)]
    return []


class HeldActivations(Callback):
    """The bytes autograd holds for backward, measured: while training, every tensor saved for backward is packed
    into an object with a finalizer, so the bytes count from the pack until autograd frees the saved tensor (a
    micro-batch's after its backward), each storage once; ``peak`` is the most held at any moment, parameters and
    the batch (alive for the whole step whatever the schedule) excluded. It knows nothing of schedules: it sees what
    is alive, not what a strategy says it keeps."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._count: dict[int, int] = {}
        self._exclude: set[int] = set()
        self._hooks: Any = None

    def on_train_start(self, trainer, module) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._exclude |= {t.untyped_storage().data_ptr() for t in _tensors(batch)}  # the batch is no activation

    def on_train_end(self, trainer, module) -> None:
        self._hooks.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = tensor.untyped_storage().data_ptr()
        if key in self._exclude or not tensor.untyped_storage().nbytes():
            return tensor
        self._count[key] = self._count.get(key, 0) + 1
        if self._count[key] == 1:
            self.live += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        held = _Held(tensor)
        weakref.finalize(held, self._release, key, tensor.untyped_storage().nbytes())
        return held

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int, nbytes: int) -> None:
        self._count[key] -= 1
        if not self._count[key]:
            del self._count[key]
            self.live -= nbytes


class LossProbe(Probe):
    """The Probe without the gradients: no ``on_before_optimizer_step`` hook, so nothing stops a strategy from
    stepping during backward."""

    on_before_optimizer_step = Callback.on_before_optimizer_step


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process since the last ``torch._dynamo.reset()`` (each recompilation
    adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_HF_SMALL = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
HF_CONFIGS = {  # small transformers models built offline from a config
    "hf_llama": dict(model_type="llama", **_HF_SMALL),
    "hf_llama_tied": dict(model_type="llama", tie_word_embeddings=True, **_HF_SMALL),
    "hf_mistral": dict(model_type="mistral", sliding_window=None, **_HF_SMALL),
    "hf_qwen2": dict(model_type="qwen2", **_HF_SMALL),  # biased q, k and v
    "hf_gpt2": dict(model_type="gpt2", vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=4,  # Conv1D,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),  # tied head
    # MoE blocks with transformers' packed experts (4, top 2); Qwen2-MoE's with a shared expert beside them
    "hf_mixtral": dict(model_type="mixtral", sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
                       **_HF_SMALL),
    "hf_qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, **_HF_SMALL),
}


def _module_and_data(case: Case, world_size: int) -> tuple[Any, Any]:
    per_replica = case.samples_per_replica or case.steps * case.accumulate * case.per_rank_batch
    samples = per_replica * case.replicas(world_size)
    if case.model == "masked":
        return MaskedRegression(), MaskedSequences(samples)
    if case.model == "routed":
        return RoutedRegression(), regression_data(samples)
    if case.model == "routed_items":
        return RoutedItemsRegression(), regression_data(samples)
    if case.model == "loss_validated":
        return LossValidatedRegression(), regression_data(samples)
    if case.model == "deferred":
        return DeferredInitNet(), sequence_regression_data(samples)
    if case.model == "batchnorm":
        return BatchNormRegression(), regression_data(samples)
    if case.model == "leaky":
        return LeakyGenerator(), regression_data(samples)
    if case.model == "llama":  # examples/llama.py: RMSNorm, rotary, SwiGLU, grouped-query attention, untied head
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from llama import Llama

        torch.manual_seed(0)
        module = Llama(vocab_size=16, max_seq_len=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                       warmup_steps=2, max_steps=10, adam_eps=1e-3)
        return module, TokenWindows(MarkovChain(16, 0.5, seed=3).sample(samples, 17, seed=4))
    if case.model in ("moe", "moe_capacity"):  # examples/moe.py: a Mixtral (llama's blocks, MoE MLPs of 4 experts)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from moe import Mixtral

        torch.manual_seed(0)
        module = Mixtral(vocab_size=16, max_seq_len=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=32,
                         experts=4, top_k=2, balance_coef=0.1, z_coef=0.01, warmup_steps=2, max_steps=10,
                         adam_eps=1e-3, capacity_factor=4.0 if case.model == "moe_capacity" else None)
        return module, TokenWindows(MarkovChain(16, 0.5, seed=3).sample(samples, 17, seed=4))
    if case.model.startswith("hf_"):  # a Hugging Face model through trainkit.hf.CausalLM, its own tp plan
        from trainkit.hf import CausalLM

        torch.manual_seed(0)
        module = CausalLM(config=HF_CONFIGS[case.model], warmup_steps=2, max_steps=10, adam_eps=1e-3)
        return module, TokenWindows(MarkovChain(16, 0.5, seed=3).sample(samples, 17, seed=4))
    if case.model in ("gpt", "gpt6", "gpt_h4"):  # tied embeddings; loss by tokens; gpt6: 8 pipeline layers
        # Adam divides each gradient by its own magnitude (plus eps), so an element whose gradient is
        # ~1e-9 turns reduction-order noise of ~1e-8 into a different update. No biases (the key bias's
        # gradient is exactly zero: softmax ignores a shift shared by all keys) and eps=1e-3 keep those
        # elements' updates continuous in the gradient; every strategy is still held to 1e-5/1e-6.
        torch.manual_seed(0)
        module = DemoGPT(vocab_size=16, block_size=16, n_layer=6 if case.model == "gpt6" else 2,
                         n_head=4 if case.model == "gpt_h4" else 2, n_embd=32,
                         warmup_steps=2, max_steps=10, bias=False, adam_eps=1e-3)
        return module, TokenWindows(MarkovChain(16, 0.5, seed=3).sample(samples, 17, seed=4))
    if case.model == "wide":  # the MLP with 128 hidden units: buckets' padding is small beside its parameters
        return Regression(hidden=128), regression_data(samples)
    return (ValidatedRegression() if case.model == "validated" else Regression()), regression_data(samples)


def run_case(case: Case, world_size: int, per_rank_batch: int, accelerator: str) -> Result:
    """Train ``case`` on this process's rank (world taken from the environment) on ``accelerator``."""
    module, data = _module_and_data(case, world_size)
    if case.onebit is not None:
        module.configure_optimizers = lambda: OneBitAdam(module.parameters(), **case.onebit)
    probe = (Probe if case.probe_grads else LossProbe)(case.record_comm, case.init_scale, case.sends_twice)
    strategy = get_strategy(case.strategy, **case.options)
    if case.compile:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # every case compiles afresh (and never meets dynamo's limit of graphs per function)
        counters.clear()
    tokens = case.model in ("gpt", "gpt6", "gpt_h4", "llama", "moe", "moe_capacity")
    val_data = (TokenWindows(MarkovChain(16, 0.5, seed=3).sample(13, 17, seed=5)) if tokens
                else regression_data(13, seed=5))
    val = DataLoader(val_data, batch_size=per_rank_batch) if case.validate else None
    held = HeldActivations() if case.watch_saved else None
    trainer = Trainer(
        accelerator=accelerator,
        activation_checkpointing=[Block] if case.checkpointing is True else case.checkpointing or None,
        val_check_interval=5 if case.validate else None,
        strategy=strategy, precision=case.precision, reduce_dtype=case.reduce_dtype,
        accumulate_grad_batches=case.accumulate, compile=case.compile,
        gradient_clip_val=case.clip, gradient_clip_algorithm=case.clip_algorithm, max_steps=case.steps, seed=0,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=[probe] + ([held] if held is not None else []),
        timeout_s=120,
        default_root_dir=tempfile.gettempdir(),
    )
    trainer.fit(module, DataLoader(data, batch_size=per_rank_batch, shuffle=True), val)
    params = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in strategy.full_parameters().items()}
    psi = sum(p.numel() for p in module.parameters())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    buffers = {n: b.detach().to("cpu", torch.float32, copy=True) for n, b in module.named_buffers()
               if b.is_floating_point()}
    if buffers:
        params |= {f"buffer:{n}": b for n, b in buffers.items()}
        everyone = strategy.all_gather_object(buffers)
        metrics["buffer_spread"] = max(float((theirs[n] - b).abs().max()) for theirs in everyone
                                       for n, b in buffers.items())
    schedule = capability(strategy, RunsSchedule)
    peak = dict(schedule.activation_peak) if schedule is not None else {}
    peaks = strategy.all_gather_object(peak | ({"held": held.peak} if held is not None else {}))
    graphs = [*probe.graphs_after_first_step, compiled_graphs()] if case.compile else []
    return Result(probe.losses, probe.grads, params, probe.comm, psi, metrics, peaks,
                  getattr(capability(strategy, StepsInBackward), "steps_in_backward", 0),
                  native.why_not("host_adam") or "", graphs)


_REFERENCES: dict[str, Result] = {}  # the runs below by what they depend on: many cases share one reference


def run_reference(case: Case, world_size: int) -> Result:
    """The single-process run on the whole global batch, on the device type the ranks ran on, held to a plain
    PyTorch loop (``tests/parity/plain.py``) on the same batches first: every strategy compared with this result is
    compared, through ``single``, with that loop."""
    single = Case(**{**asdict(case), "name": "reference", "strategy": "single", "options": {}, "compile": False,
                     "reduce_dtype": None})
    replicas = case.replicas(world_size)
    key = json.dumps([asdict(single), replicas, accelerator_for(world_size)], sort_keys=True, default=str)
    if key not in _REFERENCES:
        result = run_case(single, replicas, case.per_rank_batch * replicas, accelerator_for(world_size))
        if not case.record_comm:
            plain = run_plain(single, replicas)
            if case.precision != "32":
                result.tolerance = derive_tolerance(single, replicas, plain)
            assert_anchored(result, plain, result.tolerance or FP32)
        _REFERENCES[key] = result
    return _REFERENCES[key]


def derive_tolerance(case: Case, world_size: int, plain: Result | None = None) -> Tolerance:
    """How far a low-precision run of ``case`` may be from its reference: ``SPREAD`` times the largest difference
    between the plain loop and its legitimate variants (``LEGITIMATE``: each micro-batch in pieces whose gradients are
    summed, the re-association every data-parallel or sharded reduction makes; the forward on low-precision working
    parameters), rounded in the case's precision. The first step's spread is near fp32's (the same forward, summed in
    another order), so a run computed in another precision falls outside it there; one that skips clipping or the
    loss scale's undoing falls outside the later steps' (tests/parity/test_anchor.py's guards)."""
    plain = plain or run_plain(case, world_size)
    legitimate = [*LEGITIMATE, *([(None, world_size)] if world_size not in (1, 2, 4) else [])]
    variants = [run_plain(case, world_size, variant, split) for variant, split in legitimate]

    def spread(get: Callable[[Result], Any]) -> float:
        return SPREAD * max((float((torch.as_tensor(get(v)) - torch.as_tensor(get(plain))).abs().max())
                             for v in variants), default=0.0)

    losses = [spread(lambda r, s=s: r.losses[s]) for s in range(len(plain.losses))]
    grads = [max((spread(lambda r, s=s, n=n: r.grads[s][n]) for n in step), default=0.0)
             for s, step in enumerate(plain.grads)]
    return Tolerance(_after_first(losses), _after_first(grads),
                     max(spread(lambda r, n=n: r.params[n]) for n in plain.params),
                     max((spread(lambda r, n=n: r.val[n]) for n in plain.val), default=0.0))


def _after_first(spreads: list[float]) -> list[float]:
    """The first step's spread, then the largest of all later steps' for each of them: from the first update on, a
    rounding's effect wanders from step to step, and a handful of variants does not bound it step by step."""
    later = max(spreads[1:], default=0.0)
    return spreads[:1] + [later] * (len(spreads) - 1)


def plain_device(world_size: int) -> str:
    """Where ``single`` runs for a world of ``world_size`` (``accelerator_for``'s choice)."""
    return "cuda" if accelerator_for(world_size) == "auto" and torch.cuda.is_available() else "cpu"


def run_plain(case: Case, world_size: int, variant: str | None = None, split: int = 1) -> Result:
    """``case`` trained by the hand-written loop of ``tests/parity/plain.py`` on what ``world_size`` ranks read in
    all (``variant`` and ``split``: see there)."""
    module, data = _module_and_data(case, world_size)
    if case.onebit is not None:
        module.configure_optimizers = lambda: OneBitAdam(module.parameters(), **case.onebit)
    replicas = case.replicas(world_size)
    val = None
    if case.validate:
        tokens = case.model in ("gpt", "gpt6", "gpt_h4")
        val = TokenWindows(MarkovChain(16, 0.5, seed=3).sample(13, 17, seed=5)) if tokens else \
            regression_data(13, seed=5) if case.model in ("regression", "validated", "batchnorm", "leaky") else None
    out = train_plain(module, data, batch_size=case.per_rank_batch * replicas, steps=case.steps,
                      precision=case.precision, accumulate=case.accumulate, clip=case.clip,
                      clip_algorithm=case.clip_algorithm, init_scale=case.init_scale, val_data=val, val_every=5,
                      device=plain_device(world_size), variant=variant, split=split)
    logged = out["val"] if case.model in ("validated", "batchnorm", "leaky") else {k: v for k, v in out["val"].items()
                                                                            if k == "val_loss"}
    return Result(out["losses"], out["grads"] if case.probe_grads else [], out["params"], val=logged)


def assert_anchored(result: Result, plain: Result, tolerance: dict[str, float]) -> None:
    """``result`` (trainkit's ``single``) matches the plain loop: losses, gradients where it read them, parameters
    and floating buffers, and every validation metric the plain loop computes."""
    assert plain.val.keys() <= result.val.keys(), (plain.val.keys(), result.val.keys())
    assert_parity(Result(result.losses, result.grads, result.params, val={k: result.val[k] for k in plain.val}),
                  plain, tolerance)


def _save(result: Result, path: Path) -> None:
    tensors = {f"param/{k}": v for k, v in result.params.items()}
    for i, grads in enumerate(result.grads):
        tensors |= {f"grad{i}/{k}": v for k, v in grads.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path.with_suffix(".safetensors")))
    path.with_suffix(".json").write_text(json.dumps({"losses": result.losses, "comm": result.comm,
                                                     "steps": len(result.grads), "psi": result.psi,
                                                     "val": result.val, "peaks": result.peaks,
                                                     "steps_in_backward": result.steps_in_backward,
                                                     "host_fallback": result.host_fallback,
                                                     "graphs": result.graphs}))


def _load(path: Path) -> Result:
    meta = json.loads(path.with_suffix(".json").read_text())
    tensors = load_file(str(path.with_suffix(".safetensors")))
    params = {k[6:]: v for k, v in tensors.items() if k.startswith("param/")}
    grads = [{k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"grad{i}/")}
             for i in range(meta["steps"])]
    return Result(meta["losses"], grads, params, meta["comm"], meta["psi"], meta["val"], meta["peaks"],
                  meta["steps_in_backward"], meta["host_fallback"], meta["graphs"])


def _worker(rank: int, world_size: int, port: int, cases: list[Case], out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    for case in cases:
        try:
            result = run_case(case, world_size, case.per_rank_batch, accelerator_for(world_size))
        except Exception:
            Path(out, f"{case.name}.rank{rank}.error").write_text(traceback.format_exc())
            raise
        if rank == 0:
            _save(result, Path(out, case.name))
    if dist.is_initialized():  # spawned processes skip atexit: release gloo's threads explicitly
        dist.barrier()
        dist.destroy_process_group()
    # Leave without interpreter finalisation: destructors of c10d's store/transport objects that run
    # there have aborted a rank now and then ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method() -> str:
    """How ranks start: "forkserver" where no GPU is visible, each rank forked from one server that has imported the
    harness (torch, trainkit, the test models) and dynamo (which every optimizer imports) once in the session, where a
    spawned rank imports them itself: seconds a rank, W ranks at a time on a few cores. "spawn" where CUDA is visible
    (a process that has asked the driver for its devices must not be forked)."""
    if torch.cuda.is_available():
        return "spawn"
    multiprocessing.set_forkserver_preload(["tests.parity.harness", "torch._dynamo"])
    return "forkserver"


def run_world(world_size: int, cases: list[Case], timeout_s: float = 600) -> dict[str, Result]:
    """Run ``cases`` on ``world_size`` ranks; results by case name (rank 0's view)."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), cases, out), nprocs=world_size,
                                 join=False, start_method=start_method())
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks did not finish {len(cases)} cases in {timeout_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            # the rank that failed first, not a peer that saw it go
            errors = sorted((p.read_text() for p in Path(out).glob("*.error")), key=lambda e: "PeerError" in e)
            raise RuntimeError(f"a rank failed:\n{errors[0] if errors else err}") from err
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
        return {case.name: _load(Path(out, case.name)) for case in cases}


def assert_parity(result: Result, reference: Result, tolerance: dict[str, float] | Tolerance | None = None) -> None:
    """``result`` matches ``reference``: every step's loss and gradients, the validation metrics and the final
    parameters, within ``tolerance`` (fp32's by default; a low-precision reference's own, derived from its run)."""
    if reference.tolerance is not None and (tolerance is None or tolerance == FP32):
        tolerance = reference.tolerance
    tolerance = tolerance or FP32

    def close(got: Any, want: Any, atol: Callable[[Tolerance], float], what: str) -> None:
        if isinstance(tolerance, Tolerance):
            torch.testing.assert_close(got, want, rtol=FP32["rtol"], atol=FP32["atol"] + atol(tolerance),
                                       msg=lambda m: f"{what} (derived tolerance): {m}")
        else:
            torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{what}: {m}")

    assert len(result.losses) == len(reference.losses) > 0
    for step, (got, want) in enumerate(zip(result.losses, reference.losses, strict=True)):
        close(got, want, lambda t, s=step: t.losses[s], f"loss at step {step}")
    assert len(result.grads) == len(reference.grads)
    for step, (got, want) in enumerate(zip(result.grads, reference.grads, strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            close(got[name], want[name], lambda t, s=step: t.grads[s], f"grad {name} at step {step}")
    assert result.val.keys() == reference.val.keys()
    for name, want in reference.val.items():
        close(result.val[name], want, lambda t: t.val, f"metric {name}")
    assert result.params.keys() == reference.params.keys()
    for name in reference.params:
        close(result.params[name], reference.params[name], lambda t: t.params, f"param {name}")
