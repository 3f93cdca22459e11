"""The parity suite's anchor: a parity case trained by a hand-written PyTorch loop, with no trainkit code in it.

The module is the user's (its ``forward``, ``training_step`` as the loss and ``configure_optimizers``); everything a
trainer does around it is written out here with torch alone: the sampler's order (one ``randperm`` per epoch, seeded
``seed + epoch``), ``torch.autocast`` for the mixed policies, parameters and floating inputs cast to bfloat16 for
"bf16-true", a ``torch.amp.GradScaler`` for "16-mixed", accumulation with the documented normalisation (each
micro-batch's mean loss weighs by its items, a window's gradients are divided by the items it held, a short final
window by what it held), an MoE's load-balancing and z-losses computed from their formulas and added to the
objective, clipping, the optimizer and a per-step LR schedule, validation metrics computed over the whole validation
set, BatchNorm's statistics as the module keeps them. It records what the harness's ``Probe`` records: each step's
window loss, the gradients just before the step (after unscaling, before clipping) and the final parameters and
floating buffers.

``variant`` trains something else on purpose, for the guard tests: "no_clip" drops clipping, "fp32" computes in
fp32 where the case asks for bfloat16 or float16, "no_unscale" steps on gradients still multiplied by the loss
scale. Two are legitimate, the roundings a strategy may make: ``split`` computes each micro-batch in that many
pieces whose gradients are summed (how data parallelism re-associates), and "working" runs the mixed policies'
forward on low-precision copies of the parameters (what ZeRO and FSDP keep as working parameters: every parameter,
not only a matmul's inputs, is rounded, and its gradient is rounded before it reaches the fp32 master). And
"replicas" is data parallelism by hand, for what one process cannot compute: each micro-batch in ``split`` parts
strided as the ranks read them, each normalised by its own BatchNorm statistics from the same starting statistics,
the first part's kept afterwards (DDP's: rank 0's buffers are broadcast).
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

SEED = 0  # the harness's Trainer(seed=0)
VAL_SAMPLES = 13


def moe_losses_by_formula(layer: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """Switch/GShard's load balance ``E * sum_e f_e P_e`` of each sequence, averaged over sequences, and ST-MoE's
    z-loss (the mean squared log-sum-exp of the router's logits), from the layer's input ``x`` and its router, in
    fp32."""
    batch, length, _ = x.shape
    with torch.autocast(x.device.type, enabled=False):  # the router's logits in fp32 under every policy
        logits = x.reshape(-1, x.shape[-1]).float() @ layer.router.weight.float().t()
    experts, k = layer.num_experts, layer.top_k
    probs = logits.softmax(-1).view(batch, length, experts)
    chosen = probs.topk(k, -1).indices
    per_sequence = []
    for b in range(batch):
        f = torch.stack([(chosen[b] == e).sum() for e in range(experts)]).float() / (k * length)
        per_sequence.append(experts * (f * probs[b].mean(0)).sum())
    return torch.stack(per_sequence).mean(), torch.logsumexp(logits, -1).square().mean()


class AuxiliaryByFormula:
    """Forward pre-hooks on every MoE layer that compute its auxiliary terms by formula while training."""

    def __init__(self, module: nn.Module) -> None:
        self.terms: list[Tensor] = []
        self.layers = [m for m in module.modules() if hasattr(m, "router") and hasattr(m, "balance_coef")]
        for layer in self.layers:
            layer.register_forward_pre_hook(self._hook)
        self.active = False

    def _hook(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if self.active:
            balance, z = moe_losses_by_formula(layer, args[0])
            self.terms.append(layer.balance_coef * balance + layer.z_coef * z)

    def take(self) -> list[Tensor]:
        terms, self.terms = self.terms, []
        return terms


class _Step(nn.Module):
    """``module.training_step`` as a forward, for ``torch.func.functional_call``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> Any:
        return self.module.training_step(batch, 0)


def _strided(batch: Any, replicas: int) -> list[Any]:
    """Each replica's part of a global batch: rank ``r`` of ``replicas`` holds samples ``r, r + replicas, ...``."""
    return [type(batch)(t[r::replicas] for t in batch) for r in range(min(replicas, batch[0].shape[0]))]


def _buffers(module: nn.Module) -> dict[str, Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def _set_buffers(module: nn.Module, values: dict[str, Tensor]) -> None:
    for n, b in module.named_buffers():
        b.copy_(values[n])


def _optimizers(module: nn.Module) -> tuple[torch.optim.Optimizer, Any, str]:
    config = module.configure_optimizers()
    if isinstance(config, torch.optim.Optimizer):
        return config, None, "step"
    scheduler = config.get("lr_scheduler")
    if isinstance(scheduler, dict):
        return config["optimizer"], scheduler["scheduler"], scheduler.get("interval", "epoch")
    return config["optimizer"], scheduler, "epoch"


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cast_floats(b, dtype) for b in batch)
    return batch


def _loss_and_items(output: Any, batch: Any) -> tuple[Tensor, Any]:
    if isinstance(output, dict):
        return output["loss"], output["num_items"]
    return output, batch[0].shape[0]  # a plain mean loss weighs by its samples


def _pieces(batch: Any, split: int) -> list[Any]:
    size = batch[0].shape[0]
    edges = [size * i // split for i in range(split + 1)]
    return [type(batch)(t[a:b] for t in batch) for a, b in itertools.pairwise(edges) if b > a]


def train_plain(module: nn.Module, data: Any, *, batch_size: int, steps: int, precision: str = "32",
                accumulate: int = 1, clip: float | None = None, clip_algorithm: str = "norm",
                init_scale: float | None = None, val_data: Any = None, val_every: int | None = None,
                device: str = "cpu", variant: str | None = None, split: int = 1) -> dict[str, Any]:
    """Train ``module`` on ``data`` for ``steps`` optimizer steps with a hand-written loop; returns the losses, the
    gradients before every step, the final parameters (and ``buffer:<name>`` floating buffers) and, with
    ``val_data``, the validation metrics after the last step (with ``val_every``: at the last optimizer step that
    completed another ``val_every`` training batches, as the Trainer's ``val_check_interval`` does)."""
    torch.manual_seed(SEED)
    if hasattr(module, "configure_model"):  # the module builds (part of) itself here, as under a trainer
        module.configure_model()
    module.to(device)
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    true_dtype = torch.bfloat16 if precision == "bf16-true" else None
    if variant == "fp32":
        low = true_dtype = None
    if true_dtype is not None:
        module.to(true_dtype)
    optimizer, scheduler, interval = _optimizers(module)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale or 2.0**16) if precision == "16-mixed" else None
    autocast = (lambda: torch.autocast(device, dtype=low)) if low is not None else nullcontext
    auxiliary = AuxiliaryByFormula(module)
    params = [p for p in module.parameters() if p.requires_grad]
    batchnorms = [(m, mod) for m, mod in module.named_modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    normed = {f"{m}.{n}" if m else n for m, mod in batchnorms  # "working": BatchNorm stays fp32, as its statistics
              for n, _ in mod.named_parameters(recurse=False)}
    losses: list[float] = []
    grads: list[dict[str, Tensor]] = []
    names = {p: n for n, p in module.named_parameters()}
    norm: float | None = None  # c: accumulate times the first micro-batch's items
    step, epoch, seen, validated, val = 0, 0, 0, 0, {}
    module.train()
    while step < steps:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        batches = list(DataLoader(data, batch_size=batch_size, sampler=order))
        for start in range(0, len(batches), accumulate):
            window, total, weighted = batches[start:start + accumulate], 0, 0.0
            for batch in window:
                replicas = variant == "replicas"
                start_buffers = _buffers(module) if replicas else {}
                for i, piece in enumerate(_strided(batch, split) if replicas else _pieces(batch, split)):
                    if replicas and i > 0:  # every replica starts from the same statistics ...
                        _set_buffers(module, start_buffers)
                    piece = [t.to(device) for t in piece]
                    if true_dtype is not None:
                        piece = _cast_floats(piece, true_dtype)
                    auxiliary.active = True
                    with autocast():
                        if variant == "working" and low is not None:  # on low-precision copies of the parameters
                            working = {f"module.{n}": p if n in normed else p.to(low)
                                       for n, p in module.named_parameters()}
                            output = torch.func.functional_call(_Step(module), working, (piece,))
                        else:
                            output = module.training_step(piece, 0)
                    auxiliary.active = False
                    if replicas and i == 0:
                        first_buffers = _buffers(module)
                    loss, items = _loss_and_items(output, piece)
                    items = int(items)
                    if norm is None:
                        norm = float(accumulate * max(items, 1))
                    objective = loss
                    for term in auxiliary.take():
                        objective = objective + term.to(loss.dtype)
                    objective = objective * (items / norm)
                    (scaler.scale(objective) if scaler is not None else objective).backward()
                    total += items
                    weighted += float(loss.detach()) * items
                if replicas:  # ... and keeps the first replica's (rank 0's, broadcast)
                    _set_buffers(module, first_buffers)
            if scaler is not None and variant != "no_unscale":
                scaler.unscale_(optimizer)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(norm / max(total, 1))
            finite = all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
            if not finite:
                raise FloatingPointError("the plain loop's gradients overflowed: lower the case's init_scale")
            grads.append({names[p]: p.grad.detach().to("cpu", torch.float32, copy=True)
                          for p in params if p.grad is not None})
            losses.append(weighted / max(total, 1))
            if clip is not None and variant != "no_clip":
                if clip_algorithm == "norm":  # torch's clip_grad_norm_, its norm taken in fp32 (a bf16 norm rounds)
                    found = [p.grad for p in params if p.grad is not None]
                    total_norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in found]))
                    coef = torch.clamp(clip / (total_norm + 1e-6), max=1.0)
                    for g in found:
                        g.mul_(coef)
                else:
                    torch.nn.utils.clip_grad_value_(params, clip)
            if scaler is not None and variant != "no_unscale":
                scaler.step(optimizer)
                scaler.update()
            else:  # (no_unscale: scaler.step would unscale what was left scaled; the optimizer steps on it as it is)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None and interval == "step":
                scheduler.step()
            step += 1
            seen += len(window)
            if val_data is not None and val_every is not None and seen // val_every > validated:
                validated = seen // val_every  # a step's boundary that completes val_every more batches
                val = validate_plain(module, val_data, batch_size, device, autocast, true_dtype)
            if step == steps:
                break
        if scheduler is not None and interval == "epoch":
            scheduler.step()
        epoch += 1
    result: dict[str, Any] = {"losses": losses, "grads": grads}
    result["params"] = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in module.named_parameters()}
    result["params"] |= {f"buffer:{n}": b.detach().to("cpu", torch.float32, copy=True)
                         for n, b in module.named_buffers() if b.is_floating_point()}
    if val_data is not None and val_every is None:
        val = validate_plain(module, val_data, batch_size, device, autocast, true_dtype)
    result["val"] = val  # after the last step (every val_every batches: after the last that completed them)
    return result


@torch.no_grad()
def validate_plain(module: nn.Module, data: Any, batch_size: int, device: str, autocast: Any,
                   true_dtype: torch.dtype | None) -> dict[str, float]:
    """The validation metrics the harness's modules log, by hand over the whole set in batches of ``batch_size``:
    the mean squared error (``val_loss``: the batches' means weighed by their samples; ``val_mse``: a torchmetrics
    ``MeanSquaredError`` updated with every batch) and the largest absolute error (``val_max``); for the demo
    GPT, the cross-entropy of every position after the first."""
    from torchmetrics import MeanSquaredError

    module.eval()
    sums, largest, seen = {"val_loss": 0.0}, 0.0, 0
    metric = MeanSquaredError().to(device)
    if true_dtype is not None:
        metric = metric.to(true_dtype)  # as the module's own metric is, when the module is cast
    for batch in DataLoader(data, batch_size=batch_size):
        x, y = (t.to(device) for t in batch)
        if true_dtype is not None:
            x, y = _cast_floats([x, y], true_dtype)
        with autocast():
            pred = module(x)
        n = x.shape[0]
        if not y.is_floating_point():  # a language model (the demo GPT's): cross-entropy from the second position
            sums["val_loss"] += float(torch.nn.functional.cross_entropy(pred[:, 1:].flatten(0, 1).float(),
                                                                        y[:, 1:].flatten())) * n
        else:  # the batch's mean squared error in the prediction's dtype, as the module computes it
            error = pred - y
            sums["val_loss"] += float(error.square().mean()) * n
            metric.update(pred, y)
            largest = max(largest, float(error.abs().max()))
        seen += n
    module.train()
    if not y.is_floating_point():
        return {"val_loss": sums["val_loss"] / seen}
    return {"val_loss": sums["val_loss"] / seen, "val_max": largest, "val_mse": float(metric.compute())}
