"""What each activation-checkpointing mode costs in time and saves in memory, on the demo GPT, one process.

Variants: none, ``"selective"`` (keep matmul and attention outputs, recompute norms, GELU, residual adds, softmax:
Korthikanti et al., 2022), ``"full"`` (the whole block again in backward), and both on every second block
(``activation_checkpointing_every=2``). A step is forward, cross-entropy, backward, AdamW step, zero grad, as the
Trainer runs it (``apply_activation_checkpointing`` is what ``Trainer(activation_checkpointing=...)`` calls). The
variants take turns in rounds, the order rotating; the median over rounds of each round's mean step is reported with
the time each mode adds over none and selective's extra time as a fraction of full's (target: at most 0.5). The
activations column is ``ActivationMeter``'s count of what one forward saves for backward.

Reference workload: demo GPT, 4 blocks of width 512, 8 heads, vocabulary 2048, batch 4 x sequence 512, fp32,
1 thread (``--threads`` to change), with torch's default attention kernel and with ``--math`` (attention written
out: the s x s softmax that selective recomputation is about).

    python benchmarks/activation_checkpointing.py            # reference workload (a few minutes)
    python benchmarks/activation_checkpointing.py --smoke    # tiny model, seconds; what CI runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainkit.activation import apply_activation_checkpointing
from trainkit.demo.gpt import DemoGPT
from trainkit_strategies import ActivationMeter

VARIANTS = [("none", None, 1), ("selective", "selective", 1), ("full", "full", 1),
            ("selective, every 2nd block", "selective", 2), ("full, every 2nd block", "full", 2)]


def build(args: argparse.Namespace, mode: str | None, every: int) -> tuple[DemoGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DemoGPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    if mode is not None:
        apply_activation_checkpointing(model, mode, every=every)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--math", action="store_true", help="pin scaled_dot_product_attention to the math kernel")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    shape = dict(layers=2, width=64, heads=4, vocab=128, seq=64, batch=2) if args.smoke else \
        dict(layers=4, width=512, heads=8, vocab=2048, seq=512, batch=4)
    vars(args).update(shape)
    if args.smoke:
        args.rounds, args.steps = 2, 1
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen))
    kernel = sdpa_kernel(SDPBackend.MATH) if args.math else nullcontext()
    with kernel:
        runs = {name: build(args, mode, every) for name, mode, every in VARIANTS}
        saved, losses = {}, {}
        for name, (model, _) in runs.items():
            with ActivationMeter(exclude=model.parameters()) as meter:
                loss = model.training_step(batch, 0)["loss"]
            loss.backward()
            model.zero_grad(set_to_none=True)
            saved[name], losses[name] = meter.bytes, loss.item()

        def step(model: DemoGPT, opt: torch.optim.Optimizer) -> None:
            model.training_step(batch, 0)["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for model, opt in runs.values():  # warm-up
            step(model, opt)
        times: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(*runs[name])
                times[name].append((time.perf_counter() - start) / args.steps)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    none = median["none"]
    print(f"demo GPT {args.layers} blocks x width {args.width}, {args.heads} heads, vocabulary {args.vocab}, batch "
          f"{args.batch} x sequence {args.seq}, fp32, {args.threads} thread(s), attention "
          f"{'math (written out)' if args.math else 'torch default (fused)'}; median of {args.rounds} rounds x "
          f"{args.steps} steps")
    print(f"{'variant':<30}{'step':>11}{'extra':>11}{'activations':>14}{'/ none':>8}  loss")
    for name in runs:
        print(f"{name:<30}{median[name] * 1e3:>8.1f} ms{(median[name] - none) * 1e3:>+8.1f} ms"
              f"{saved[name] / 1e6:>11.2f} MB{saved[name] / saved['none']:>8.3f}  {losses[name]:.6f}")
    extra_full, extra_selective = median["full"] - none, median["selective"] - none
    fraction = f"{extra_selective / extra_full:.3f}" if extra_full > 0 else "n/a (full added no time)"
    print(f"selective's extra time / full's: {fraction} (target <= 0.5); full adds "
          f"{extra_full / none:.1%} to a step, selective {extra_selective / none:.1%}")
    print(f"losses equal across variants: {len(set(losses.values())) == 1}")


if __name__ == "__main__":
    main()
