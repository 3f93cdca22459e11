"""Benchmarks run in their smoke mode (they print ratios; timings are never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # processes of their own (see conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_overhead_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_overhead.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raw PyTorch loop" in proc.stdout and "Trainer (defaults: all on)" in proc.stdout


def test_strategies_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "strategies.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainkit ddp" in proc.stdout and "scaling efficiency" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("targets: not checked"), proc.stdout  # a tiny model: no targets


def test_strategies_only_and_ddp_phases_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "strategies.py"), "--smoke", "--only",
                           "trainkit ddp,torch DDP"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x torch DDP" in proc.stdout and "trainkit zero1" not in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_phases.py"), "--rounds", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainkit reduce_gradients" in proc.stdout and "torch DDP step" in proc.stdout, proc.stdout


def test_cpu_optimizer_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_optimizer.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainkit bf16 in, bf16 out (CPU device)" in proc.stdout and "plain copy" in proc.stdout


def test_checkpoint_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "async stall / sync stall" in proc.stdout


def test_offload_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W=2  trainkit zero_offload" in proc.stdout


def test_pipeline_schedules_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline_schedules.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for schedule, reference in (("1f1b", "Schedule1F1B"), ("interleaved_1f1b", "ScheduleInterleaved1F1B"),
                                ("zero_bubble", "ScheduleInterleavedZeroBubble")):
        assert any(line.startswith(schedule) and line.endswith(f"vs torch {reference}")
                   for line in proc.stdout.splitlines()), proc.stdout


def test_tensor_parallel_smoke():
    """Timings are printed, never asserted; what is asserted is deterministic: trainkit's tp=2 (with and without
    sequence parallelism) computes DTensor's losses, and the bytes its collectives moved in one step equal the
    Megatron / Korthikanti formula, kind by kind."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("ratio trainkit / torch DTensor") == 2, out
    checks = [line for line in out.splitlines() if line.startswith("byte check:")]
    assert len(checks) == 6 and all(line.endswith(" agree") for line in checks), out
    for line in out.splitlines():
        if line.startswith("loss trainkit"):
            worst = float(line.rsplit(", ", 1)[1].split()[0])
            assert worst <= 1e-5, line


def test_activation_checkpointing_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "activation_checkpointing.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "selective's extra time / full's" in proc.stdout
    assert "losses equal across variants: True" in proc.stdout  # recomputation changes no number


def test_context_parallel_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x single (target <= 0.75)" in proc.stdout
    work = next(line for line in proc.stdout.splitlines() if line.startswith("attention work per rank"))
    first, second = work.split(": ")[1].strip("[]").split(", ")
    assert first == second  # causal load balancing: both ranks compute as many chunk pairs


def test_experts_smoke():
    """Expert parallelism beside torch's all_to_all_single and expert loops: the same model from the same seed gives
    the same first loss."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "experts.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x reference (target <= 1.0)" in proc.stdout
    loss = next(line for line in proc.stdout.splitlines() if line.startswith("first-step loss"))
    trainkit, reference = (float(part.split()[-1]) for part in loss.split(":", 1)[1].split(","))
    assert abs(trainkit - reference) < 1e-5, loss


def test_link_smoke():
    """The link benchmark's workers and report over loopback (the shaped link needs root; the smoke needs none)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "link.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("trainkit ddp", "trainkit zero2", "trainkit fsdp", "torch DDP", "trainkit ddp + 1-bit Adam",
                "trainkit HSDP (shard in node, replicate across)", "trainkit pipeline 1F1B (a stage per node) x 2"):
        assert row in proc.stdout, row
    assert "2x2 (4 ranks), loopback" in proc.stdout
    assert proc.stdout.count("targets: not checked") == 2, proc.stdout  # a tiny model over loopback: no targets


def test_compile_smoke():
    """The benchmark runs the compiled demo GPT beside eager and exits non-zero if a longer run compiled more."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = proc.stdout.splitlines()[-2].split()
    assert row[-2:] == ["1,", "1"], proc.stdout  # one graph, at both lengths


def test_link_smoke_context_parallel():
    """The link benchmark's context-parallel layout: the three attention methods beside one rank on the sequence."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "link.py"), "--smoke", "--layouts", "cp"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("trainkit cp2 ring", "trainkit cp2 all_gather", "trainkit cp2 ulysses", "1 rank, the whole sequence"):
        assert row in proc.stdout, row


def test_setup_smoke():
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "setup.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transformers from_config" in proc.stdout and "trainkit fsdp" in proc.stdout, proc.stdout
