"""Manual optimization with two optimizers (a GAN in the shape of Lightning's example) under every strategy that runs
it, held to a hand-written PyTorch loop of the same algorithm on the whole global batch; and resumed mid-epoch
across strategies.

One process group of two ranks runs every case in turn (``_world``); each rank writes its losses."""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from tests.helpers import accelerator_for
from tests.parity.gan import GAN, Dropped, dropped_plain, gan_data, train_plain
from tests.parity.harness import free_port
from trainkit import Trainer
from trainkit.errors import ConfigurationError
from trainkit_strategies import get_strategy

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
RESUMED = ("ddp", "zero2", "zero3", "fsdp")  # each resumes the ddp checkpoint taken mid-epoch
PER_RANK, WORLD, EPOCHS = 4, 2, 2  # 8 batches an epoch at two ranks; 16 batches, 32 optimizer steps
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _fit(strategy: str, root: Path, world: int, max_steps: int = -1, ckpt_path: str | None = None,
         clip: float | None = None) -> tuple[list[torch.Tensor], Trainer]:
    module = GAN(clip=clip)
    trainer = Trainer(strategy=strategy, devices=world, accelerator=accelerator_for(world), max_epochs=EPOCHS,
                      max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root, seed=0)
    trainer.fit(module, DataLoader(gan_data(), batch_size=PER_RANK if world > 1 else PER_RANK * WORLD),
                ckpt_path=ckpt_path)
    return [loss.cpu() for loss in module.losses], trainer


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        results: dict[str, torch.Tensor] = {}
        for strategy in STRATEGIES:
            losses, trainer = _fit(strategy, Path(out, strategy), WORLD)
            results[strategy] = torch.stack(losses)
            results[f"{strategy}.steps"] = torch.tensor(trainer.global_step)
        dist.barrier()
        _, source = _fit("ddp", Path(out, "source"), WORLD, max_steps=10)  # 5 of the epoch's 8 batches
        checkpoint = str(source.resolve_ckpt_path("last"))
        for strategy in RESUMED:
            losses, _ = _fit(strategy, Path(out, f"resumed-{strategy}"), WORLD, ckpt_path=checkpoint)
            results[f"resumed.{strategy}"] = torch.stack(losses)
        losses, _ = _fit("zero2", Path(out, "clipped"), WORLD, clip=0.05)
        results["clipped.zero2"] = torch.stack(losses)
        for strategy in ("ddp", "zero2"):  # ddp: the second backward leaves ``a`` unused, as torch's DDP needs told
            dropped = Dropped()
            engine = get_strategy("ddp", find_unused_parameters=True) if strategy == "ddp" else strategy
            Trainer(strategy=engine, devices=WORLD, accelerator=accelerator_for(WORLD), max_epochs=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    default_root_dir=out).fit(dropped, DataLoader(gan_data(), batch_size=PER_RANK))
            whole = dropped.trainer.strategy.full_parameters()
            results |= {f"dropped.{strategy}.{n}": p.detach().cpu() for n, p in whole.items()}
        if rank == 0:
            torch.save(results, Path(out, "results.pt"))
    except Exception:
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("manual"))
    ctx = mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 600
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError("the two ranks did not finish the manual-optimization cases in 600 s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        errors = [p.read_text() for p in Path(out).glob("*.error")]
        raise RuntimeError(f"a rank failed:\n{errors[0] if errors else err}") from err
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
    results = torch.load(Path(out, "results.pt"))
    results["source"] = Path(out, "source")
    return results


def test_single_equals_the_plain_loop_bitwise(tmp_path):
    losses, trainer = _fit("single", tmp_path, 1)
    plain = train_plain(EPOCHS * 8, PER_RANK * WORLD)
    assert trainer.global_step == 2 * len(plain)  # each optimizer's step is a global step, as in Lightning
    assert torch.equal(torch.stack(losses), torch.stack(plain))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_optimizers_match_the_plain_loop(world, strategy):
    plain = torch.stack(train_plain(EPOCHS * 8, PER_RANK * WORLD))
    torch.testing.assert_close(world[strategy], plain, **TOL)
    assert int(world[f"{strategy}.steps"]) == 2 * len(plain)
    assert not torch.equal(plain[0], plain[-1])  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("strategy", RESUMED)
def test_resumes_mid_epoch_across_strategies(world, strategy):
    """ddp's checkpoint after 5 of 8 batches, resumed under each: the remaining 11 batches as the uninterrupted run."""
    resumed = world[f"resumed.{strategy}"]
    assert resumed.shape[0] == EPOCHS * 8 - 5
    uninterrupted = world[strategy][5:]
    if strategy == "ddp":
        assert torch.equal(resumed, uninterrupted)
    torch.testing.assert_close(resumed, uninterrupted, **TOL)


@pytest.mark.slow
def test_resumes_at_another_world_size(world, tmp_path):
    """ddp's two-rank checkpoint after 5 batches, resumed by one process on the whole global batches."""
    source = Trainer(logger=False, default_root_dir=world["source"]).resolve_ckpt_path("last")
    losses, _ = _fit("single", tmp_path, 1, ckpt_path=str(source))
    plain = torch.stack(train_plain(EPOCHS * 8, PER_RANK * WORLD))[5:]
    torch.testing.assert_close(torch.stack(losses), plain, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ("ddp", "zero2"))
def test_zero_grad_drops_the_windows_gradients(world, strategy):
    plain = dropped_plain(8, PER_RANK * WORLD)
    for name, value in plain.items():
        torch.testing.assert_close(world[f"dropped.{strategy}.{name}"], value, **TOL)
    assert torch.equal(world[f"dropped.{strategy}.a.weight"], Dropped().a.weight.detach())  # never stepped


@pytest.mark.slow
def test_clip_gradients_clips_its_optimizer_by_the_global_norm(world):
    plain = torch.stack(train_plain(EPOCHS * 8, PER_RANK * WORLD, clip=0.05))
    torch.testing.assert_close(world["clipped.zero2"], plain, **TOL)
    assert not torch.allclose(plain, world["zero2"], **TOL)  # clipping at 0.05 changes the curve


def test_several_optimizers_under_automatic_optimization_are_refused(tmp_path):
    class Automatic(GAN):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = True

    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="automatic_optimization = False"):
        trainer.fit(Automatic(), DataLoader(gan_data(), batch_size=8))


@pytest.mark.parametrize("strategy", ("zero_offload", "pipeline", "parallel"))
def test_strategies_that_cannot_step_by_hand_refuse_at_setup(tmp_path, strategy):
    trainer = Trainer(strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="single, ddp, zero1, zero2, zero3 and fsdp"):
        trainer.fit(GAN(), DataLoader(gan_data(), batch_size=8))
