"""Unfreezing mid-run (Lightning's computer_vision_fine_tuning.py shape: a frozen feature extractor with BatchNorm, a
head, the extractor unfrozen at epoch 1 into a new param group) under ``single`` and ``ddp`` at 2 ranks: equal to a
hand-written PyTorch loop doing the same freeze, unfreeze and ``add_param_group``, and resumed bitwise from
checkpoints on either side of the unfreeze, through ``BaseFinetuning`` and through a plain callback calling
``optimizer.add_param_group``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainkit as tk
from tests.helpers import accelerator_for
from tests.parity.harness import free_port
from trainkit.callbacks import BaseFinetuning, Callback

pytestmark = pytest.mark.slow  # ranks of their own, and a dozen fits

LR, GAMMA, MILESTONE = 1e-2, 0.5, 2  # Adam's rate, MultiStepLR halving every group's rate after epoch 1
UNFREEZE, STEPS, PER_RANK, SAMPLES = 1, 16, 4, 32  # 4 steps an epoch at either world size: 4 epochs
SPLITS = (2, 10)  # checkpoints mid-epoch 0 (before the unfreeze) and mid-epoch 2 (after it)


class FineTuned(tk.TrainModule):
    """A feature extractor with BatchNorm (a pre-trained backbone's stand-in) and a classifier head; binary
    cross-entropy on logits; Adam over the trainable parameters with a MultiStepLR, as the Lightning example."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # no bias before a norm (a ResNet's convolutions have none): its gradient is zero but for rounding, which Adam,
        # dividing by its magnitude, would turn into steps that differ with the order of the sums
        self.feature_extractor = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                                               nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.feature_extractor(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.binary_cross_entropy_with_logits(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=LR)
        return [optimizer], [torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[MILESTONE], gamma=GAMMA)]


class Milestone(BaseFinetuning):
    """The Lightning example's callback at one milestone; BatchNorm frozen with the extractor (``train_bn=False``)."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.feature_extractor, train_bn=False)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == UNFREEZE:
            self.unfreeze_and_add_param_group(pl_module.feature_extractor, optimizer, train_bn=False)


class FrozenExtractor(FineTuned):
    """The plain callback's model: the extractor frozen by the module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.feature_extractor.requires_grad_(False)


class AddGroup(Callback):
    """``optimizer.add_param_group`` by hand at the unfreeze epoch (no state of its own to resume)."""

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == UNFREEZE:
            module.feature_extractor.requires_grad_(True)
            trainer.optimizer.add_param_group({"params": list(module.feature_extractor.parameters()), "lr": LR / 10})


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs.detach()))


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=gen)
    return TensorDataset(x, (x[:, :1] + 0.5 * x[:, 1:2] > 0).float())


def fit(root: Path, kind: str, strategy: str, max_steps: int, ckpt_path: str | None = None) -> dict[str, Any]:
    """One fit; rank 0's losses and every parameter at its end."""
    module, callback = (FineTuned(), Milestone()) if kind == "base" else (FrozenExtractor(), AddGroup())
    losses = Losses()
    batch = PER_RANK * (2 if strategy == "single" else 1)
    trainer = tk.Trainer(strategy=strategy, accelerator=accelerator_for(2), max_steps=max_steps, seed=0,
                         logger=False, enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=root,
                         callbacks=[callback, losses], timeout_s=120)
    trainer.fit(module, DataLoader(data(), batch_size=batch, shuffle=True), ckpt_path=ckpt_path)
    params = {n: p.tolist() for n, p in trainer.strategy.full_parameters().items()}
    return {"losses": losses.losses, "params": params, "groups": len(trainer.optimizer.param_groups)}


def runs(root: Path, strategy: str) -> dict[str, Any]:
    """Per callback kind: the whole run, and each split (stopped at a step, resumed from its last checkpoint)."""
    out: dict[str, Any] = {}
    for kind in ("base", "plain"):
        out[kind] = fit(root / kind / "full", kind, strategy, STEPS)
        for split in SPLITS if kind == "base" else SPLITS[1:]:
            where = root / kind / f"split{split}"
            first = fit(where, kind, strategy, split)
            out[f"{kind}{split}"] = {"first": first, "rest": fit(where, kind, strategy, STEPS, ckpt_path="last")}
    return out


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = runs(Path(root), "ddp")
        if rank == 0:
            Path(root, "result.json").write_text(json.dumps(result))
    except Exception:
        import traceback

        Path(root, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        single = runs(Path(root, "single"), "single")
        ctx = mp.start_processes(_worker, args=(free_port(), str(Path(root, "ddp"))), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 600
        try:
            while not ctx.join(timeout=2):
                assert time.monotonic() < deadline, "2 ranks did not finish in 600 s"
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            errors = [p.read_text() for p in Path(root, "ddp").glob("*.error")]
            raise RuntimeError(f"a rank failed:\n{errors[0] if errors else err}") from err
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
        return {"single": single, "ddp": json.loads(Path(root, "ddp", "result.json").read_text())}


def by_hand(replicas: int) -> dict[str, Any]:
    """The same training in plain PyTorch: the extractor frozen (BatchNorm not tracking), Adam over the head, the
    sampler's order (one randperm per epoch seeded 0 + epoch), each replica's strided part of a global batch normalised
    by its own statistics from the same start and the first replica's kept (ddp's broadcast), gradients averaged
    over the replicas; at epoch 1 the extractor trainable and its non-BatchNorm parameters added as a group at a tenth
    of the first group's rate; the scheduler stepped at every epoch's end. Replica 0's losses."""
    module = FineTuned()
    extractor = module.feature_extractor
    norms = [m for m in extractor if isinstance(m, nn.BatchNorm1d)]
    extractor.requires_grad_(False)
    for bn in norms:
        bn.track_running_stats = False
    optimizer = torch.optim.Adam(module.fc.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[MILESTONE], gamma=GAMMA)
    dataset, losses, step, epoch = data(), [], 0, 0
    while step < STEPS:
        if epoch == UNFREEZE:
            extractor.requires_grad_(True)
            for bn in norms:
                bn.track_running_stats = True
            rest = [p for m in extractor if not isinstance(m, nn.BatchNorm1d) for p in m.parameters()]
            optimizer.add_param_group({"params": rest, "lr": optimizer.param_groups[0]["lr"] / 10})
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
        for x, y in DataLoader(dataset, batch_size=PER_RANK * 2, sampler=order):
            start = {n: b.clone() for n, b in module.named_buffers()}
            for r in range(replicas):
                if r > 0:
                    kept = {n: b.clone() for n, b in module.named_buffers()}
                    for n, b in module.named_buffers():
                        b.copy_(start[n])
                loss = F.binary_cross_entropy_with_logits(module(x[r::replicas]), y[r::replicas])
                (loss / replicas).backward()
                if r == 0:
                    losses.append(float(loss.detach()))
            if replicas > 1:
                for n, b in module.named_buffers():
                    b.copy_(kept[n])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        scheduler.step()
        epoch += 1
    return {"losses": losses, "params": {n: p.detach() for n, p in module.named_parameters()}}


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_base_finetuning_matches_a_hand_written_loop(results, strategy):
    """Losses of every step and the final parameters, fp32 within 1e-6; the head's group and the added one."""
    got, want = results[strategy]["base"], by_hand(1 if strategy == "single" else 2)
    assert got["groups"] == 2
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(torch.tensor(got["params"][name]), value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
@pytest.mark.parametrize(("kind", "split"), [("base", 2), ("base", 10), ("plain", 10)])
def test_a_resumed_run_continues_bitwise_across_the_unfreeze(results, strategy, kind, split):
    """Stopped at ``split`` (mid-epoch 0: the unfreeze happens after the resume; mid-epoch 2: the checkpoint holds the
    added group, its Adam state and its halved rate) and resumed from the last checkpoint: every later loss and the
    final parameters equal the uninterrupted run's exactly. The plain callback adds its group by hand: the group comes
    back from the checkpoint alone."""
    full, first, rest = results[strategy][kind], results[strategy][f"{kind}{split}"]["first"], \
        results[strategy][f"{kind}{split}"]["rest"]
    assert first["losses"] == full["losses"][:split]
    assert rest["losses"] == full["losses"][split:]
    assert rest["params"] == full["params"]
    assert rest["groups"] == full["groups"] == 2
