"""Everything that only a GPU machine can check, in one command, ending in a table to paste into docs/gpu.md.

    python benchmarks/gpu_check.py                  # every check (about 15 minutes on one H100, 5.4B offload too)
    python benchmarks/gpu_check.py --quick          # without the 5.4B offload comparison (about 5 minutes)
    python benchmarks/gpu_check.py --offload-only   # the 5.4B offload comparison alone, phases and timeline (~7 min)

What it runs, each as its own process (a failure is a row, not the end of the run):

- the ``cuda``-marked tests (``tests/e2e/test_cuda.py``: every strategy's one-rank path on the GPU against
  ``single``, autocast and loss scaling against torch's own loop, page-locked offload buffers, the setup peak of
  ZeRO-Offload, checkpoints moving between GPU and CPU, peak memory from the allocator);
- the default job (``trainkit fit``) in fp32, fp32 with TF32, and bf16-mixed: its validation excess over the
  Markov entropy floor and its time per step;
- every strategy at one rank on the demo GPT in bf16-mixed and 16-mixed (loss scaling): it trains, validates and
  prints the same kind of loss;
- ZeRO-Offload at 5.4B parameters beside DeepSpeed's ZeRO-2 offload when DeepSpeed is installed, each in a process
  of its own, with trainkit's phases and the timeline of its host steps against backward
  (``benchmarks/offload.py --gpu --shapes gpt-5.4B --phases``);
- with two GPUs or more: every strategy on NCCL, and the pipeline's four schedules (one rank per GPU).

Nothing here asserts a speed; the table records what was seen.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["single", "ddp", "zero1", "zero2", "zero_offload", "zero3", "fsdp", "pipeline"]
SCHEDULES = [("1f1b", []), ("gpipe", []), ("zero_bubble", []),
             ("interleaved_1f1b", ["--trainer.strategy.virtual_stages", "2", "--model.n_layer", "4"])]
FINAL = re.compile(r"validation loss ([\d.]+) nats(?: \| Markov entropy floor H = [\d.]+ nats \| excess ([-\d.]+) "
                   r"nats)? \| (\d+) steps in ([\d.]+) s")


def run(args: list[str], timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
        return 124, out + f"\n(timed out after {timeout:.0f} s)", time.monotonic() - start


def fit(root: Path, *extra: str, steps: int = 300, timeout: float = 600) -> tuple[str, str]:
    """``trainkit fit`` of the demo with ``extra`` flags: ("pass"/"FAIL", what it showed)."""
    args = [sys.executable, "-m", "trainkit.cli", "fit", "--trainer.enable_progress_bar", "false",
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
            "--trainer.default_root_dir", str(root), *extra]
    code, out, elapsed = run(args, timeout)
    found = FINAL.search(out)
    if code or found is None:
        return "FAIL", f"exit {code}: {_last_error(out)}"
    loss, excess, done, seconds = found.groups()
    detail = f"val loss {float(loss):.4f}" + (f", excess {float(excess):.4f} nats" if excess else "")
    return "pass", f"{detail}, {1e3 * float(seconds) / int(done):.1f} ms/step (whole fit, {elapsed:.0f} s)"


def _last_error(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:200].replace("|", "/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="leave out the 5.4B offload comparison")
    parser.add_argument("--offload-only", action="store_true", help="only the 5.4B offload comparison")
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="where runs write their files")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU is visible; run this on a GPU machine.")
    gpus = torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str]] = []

    def row(check: str, result: str, detail: str) -> None:
        rows.append((check, result, detail))
        print(f"{check:<48} {result:<5} {detail}", flush=True)

    if args.offload_only:
        row(*offload(args.out))
        finish(gpus, rows)

    code, out, elapsed = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], 1800)
    summary = re.findall(r"(\d+ (?:passed|failed|skipped|error)\w*)", out.strip().splitlines()[-1] if out else "")
    row("cuda-marked tests", "pass" if code == 0 else "FAIL", f"{', '.join(summary)} in {elapsed:.0f} s")

    row("default job, fp32", *fit(args.out / "fp32"))
    row("default job, fp32 with TF32", *fit(args.out / "tf32", "--trainer.float32_matmul_precision", "high"))
    row("default job, bf16-mixed", *fit(args.out / "bf16", "--trainer.precision", "bf16-mixed"))

    for name in STRATEGIES:
        for precision in ("bf16-mixed", "16-mixed"):
            row(f"{name}, 1 rank, {precision}",
                *fit(args.out / f"{name}-{precision}", "--trainer.strategy", name, "--trainer.precision", precision,
                     steps=100))

    if not args.quick:
        row(*offload(args.out))

    if gpus >= 2:
        for name in STRATEGIES[1:]:
            row(f"{name}, {gpus} GPUs (NCCL), bf16-mixed",
                *fit(args.out / f"nccl-{name}", "--trainer.devices", str(gpus), "--trainer.strategy", name,
                     "--trainer.precision", "bf16-mixed", steps=100))
        for schedule, extra in SCHEDULES:
            row(f"pipeline {schedule}, {gpus} GPUs (NCCL)",
                *fit(args.out / f"nccl-pipeline-{schedule}", "--trainer.devices", str(gpus), "--trainer.strategy",
                     "pipeline", "--trainer.strategy.schedule", schedule, "--trainer.strategy.microbatches",
                     str(2 * gpus), *extra, steps=100))
    else:
        row("strategies on NCCL", "skip", f"{gpus} GPU visible: NCCL runs need two or more")

    finish(gpus, rows)


def offload(out: Path) -> tuple[str, str, str]:
    """The 5.4B ZeRO-Offload comparison (``benchmarks/offload.py``), its rows kept whole in ``out/offload.*``."""
    code, text, _ = run([sys.executable, "benchmarks/offload.py", "--gpu", "--shapes", "gpt-5.4B", "--phases",
                         "--steps", "4", "--timeout", "300", "--json", str(out / "offload.json")], 470)
    (out / "offload.txt").write_text(text)
    print(text, flush=True)
    lines = [line.strip() for line in text.splitlines() if "gpt-5.4B" in line or "phases" in line]
    return ("zero_offload 5.4B beside DeepSpeed", "pass" if code == 0 and lines else "FAIL",
            " / ".join(lines)[:600] or _last_error(text))


def finish(gpus: int, rows: list[tuple[str, str, str]]) -> None:
    name = torch.cuda.get_device_name(0)
    print(f"\n{gpus} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}\n")
    print("| check | result | detail |\n|---|---|---|")
    for check, result, detail in rows:
        print(f"| {check} | {result} | {detail} |")
    sys.exit(1 if any(result == "FAIL" for _, result, _ in rows) else 0)


if __name__ == "__main__":
    main()
