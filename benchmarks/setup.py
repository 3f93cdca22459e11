"""Setup time of a Hugging Face Llama built from its config: trainkit's (built on the meta device, then each tensor
materialised with its one-process value) against transformers' own ``from_config`` in plain PyTorch, moved to the
device, in one process.

trainkit records ``configure_model`` on meta and replays what a rank keeps; the random draws are worked out as the
replay makes them, so each number is drawn once, as ``from_config`` draws it (recorder.py). Printed: the median of
each over the rounds (alternating, after one warm-up of each) and its ratio to ``from_config``; the target is 1.0.

    python benchmarks/setup.py            # a 202M-parameter Llama (as tests/e2e/test_setup_memory.py), 5 rounds
    python benchmarks/setup.py --smoke    # a tiny one, one round; what CI runs
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch

from trainkit import transforms
from trainkit.hf import CausalLM
from trainkit_strategies import Environment, Precision, get_strategy

LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 15, "num_attention_heads": 16, "num_key_value_heads": 4,
         "max_position_embeddings": 256, "tie_word_embeddings": True}
SMOKE = {**LLAMA, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def plain(config: dict, device: torch.device) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(device)
    torch.optim.AdamW(model.parameters())
    took = time.perf_counter() - start
    del model
    return took


def trainkit(config: dict, device: torch.device, name: str) -> float:
    start = time.perf_counter()
    torch.manual_seed(0)
    strategy = get_strategy(name)
    strategy.setup_environment(Environment.from_env(device.type))
    module = CausalLM(config=config)
    transforms.build(module, strategy)
    strategy.setup(module, torch.optim.AdamW(module.parameters()), Precision.from_name("32"))
    took = time.perf_counter() - start
    strategy.teardown()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", nargs="+", default=["single", "ddp", "fsdp"])
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free one: the strategies' one-rank process groups
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    config, rounds = (SMOKE, 1) if args.smoke else (LLAMA, args.rounds)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = {"transformers from_config": lambda: plain(config, device)}
    runs |= {f"trainkit {name}": (lambda n=name: trainkit(config, device, n)) for name in args.strategies}
    for run in runs.values():  # warm-up: lazy imports, first allocations
        run()
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            times[label].append(run())
    base = statistics.median(times["transformers from_config"])
    print(f"setup of a {'tiny' if args.smoke else '202M-parameter'} Llama on {device.type}, {rounds} round(s), "
          "median seconds (ratio to from_config; target <= 1.0)")
    for label, taken in times.items():
        print(f"  {label:<28} {statistics.median(taken):7.3f} s   {statistics.median(taken) / base:5.2f}x")


if __name__ == "__main__":
    main()
