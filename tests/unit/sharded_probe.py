"""Run in a fresh process by test_sharded_memory.py: sharded setup of a meta-initialised model on one
simulated rank (torch's fake process group), reporting peak resident memory and per-rank bytes as JSON.

    python tests/unit/sharded_probe.py <strategy> <world_size> <rank> <model: blocks|gpt1b> <precision>
"""

from __future__ import annotations

import json
import resource
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainkit.demo.gpt import Block, GPTConfig, TinyGPT
from trainkit_strategies import Environment, Precision, get_strategy


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Make the kernel's high-water mark (VmHWM) start again from the current RSS (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    name, world, rank, model_name, precision = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    options = {"auto_wrap": [Block]} if name == "fsdp" else {"persistence_threshold": 0}
    # warm up on a tiny model: whatever setup imports lazily is loaded before memory is measured
    warm = get_strategy(name, **options)
    warm.setup_environment(Environment(rank=rank, world_size=world))
    with warm.init_context():
        tiny = nn.Sequential(*[Block(GPTConfig(n_embd=16, n_head=2)) for _ in range(2)])
    warm.setup(tiny, torch.optim.AdamW(tiny.parameters(), lr=1e-3), Precision.from_name(precision))
    strategy = get_strategy(name, **options)
    strategy.setup_environment(Environment(rank=rank, world_size=world))
    with strategy.init_context():
        if model_name == "gpt1b":  # the demo GPT scaled to ~1B parameters
            model = TinyGPT(GPTConfig(vocab_size=32768, block_size=2048, n_layer=20, n_head=16, n_embd=2048))
        else:  # 16 blocks of 3.15M parameters: 50.4M in all, 192 MiB in fp32
            model = nn.Sequential(*[Block(GPTConfig(n_embd=512, n_head=8)) for _ in range(16)])
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = rss_bytes()
    reset_peak()  # earlier peaks (imports, the warm-up) must not count
    strategy.setup(model, optimizer, Precision.from_name(precision))
    peak = peak_bytes() - before
    layouts = [b.layout for b in strategy.buckets]
    psi = sum(f.numel for f in layouts)
    unit = max(sum(b.layout.padded for b in u.buckets) for u in strategy.units) * 4
    report = strategy.memory_report()
    print(json.dumps({
        "psi": psi, "full_fp32": 4 * psi, "unit_fp32": unit, "peak_rss_delta": peak,
        "shard_elements": sum(f.piece for f in layouts), "device": report.device, "host": report.host,
        "meta_left": sum(p.is_meta for p in model.parameters()),
    }))


if __name__ == "__main__":
    main()
