"""Train the demo's TinyGPT on any text file, byte by byte, with any strategy.

    python examples/gpt.py fit --data.path input.txt
    python examples/gpt.py fit --data.path input.txt --trainer.devices 2 --trainer.strategy fsdp
    python examples/gpt.py fit --data.path input.txt --ckpt_path last         # resume
    python examples/gpt.py sample --checkpoint checkpoints --prompt "The "    # generate from a checkpoint

Tokens are the file's UTF-8 bytes (vocabulary 256), so any file works without a tokenizer. Every
``--trainer.*``, ``--model.*`` and ``--data.*`` option is listed by ``python examples/gpt.py fit --help``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from trainkit import DataModule
from trainkit.checkpoint import CheckpointReader
from trainkit.cli import main
from trainkit.demo.gpt import DemoGPT
from trainkit.rundir import newest

VOCAB = 256


class ByteWindows(Dataset):
    """Windows of ``length + 1`` bytes starting every ``stride`` bytes; items are (input, target)."""

    def __init__(self, data: Tensor, length: int, stride: int) -> None:
        if data.numel() < length + 1:
            raise ValueError(f"The text has {data.numel()} bytes, fewer than one window of {length + 1}; "
                             "use a longer file or a smaller --model.block_size and --data.block_size.")
        self.data, self.length, self.stride = data, length, stride

    def __len__(self) -> int:
        return (self.data.numel() - self.length - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[index * self.stride: index * self.stride + self.length + 1]
        return chunk[:-1], chunk[1:]


class TextData(DataModule):
    """A text file as bytes: the first ``1 - val_fraction`` for training, the rest for validation.

    Args:
        path: the text file. block_size: tokens per example (at most the model's block_size).
        stride: bytes between the starts of consecutive training windows (default: block_size / 2).
        val_fraction: share of the file held out. batch_size: per-rank batch size.
    """

    vocab_size = VOCAB

    def __init__(self, path: str, block_size: int = 128, stride: int | None = None, val_fraction: float = 0.1,
                 batch_size: int = 32, num_workers: int = 0) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}.")
        self.path, self.block_size, self.val_fraction = Path(path), block_size, val_fraction
        self.stride = stride or max(1, block_size // 2)
        self.batch_size, self.num_workers = batch_size, num_workers
        self._splits: dict[str, Tensor] = {}

    def setup(self, stage: str) -> None:
        if self._splits:
            return
        if not self.path.is_file():
            raise FileNotFoundError(f"--data.path {self.path} is not a file.")
        data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8).long()
        cut = int(data.numel() * (1 - self.val_fraction))
        self._splits = {"train": data[:cut], "val": data[cut:]}

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return DataLoader(ByteWindows(self._splits["train"], self.block_size, self.stride),
                          batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers,
                          pin_memory=torch.cuda.is_available())  # pinned: copies to the GPU overlap compute

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(ByteWindows(self._splits["val"], self.block_size, self.block_size),
                          batch_size=self.batch_size, num_workers=self.num_workers,
                          pin_memory=torch.cuda.is_available())


class TextGPT(DemoGPT):
    """DemoGPT with a byte vocabulary and a larger default shape for real text."""

    def __init__(self, vocab_size: int = VOCAB, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.1, lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 100, max_steps: int = 5000, bias: bool = True, adam_eps: float = 1e-8) -> None:
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, lr, weight_decay,
                         warmup_steps, max_steps, bias, adam_eps)


@torch.no_grad()
def sample(checkpoint: str, prompt: str, length: int, temperature: float, seed: int) -> str:
    """Load a checkpoint written by any strategy into a plain TextGPT and continue ``prompt``."""
    path = Path(checkpoint)
    reader = CheckpointReader(newest(path) if (path / "latest").is_file() else path)  # a directory: its newest run's
    hparams = {k: v for k, v in reader.meta["hyperparameters"].items() if k in TextGPT.__init__.__annotations__}
    model = TextGPT(**hparams).eval()
    state = {k.removeprefix("model/"): reader.full(k) for k in reader.keys() if k.startswith("model/")}
    model.load_state_dict(state, strict=False)  # the tied lm_head.weight is stored once, as wte.weight
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
    for _ in range(length):
        logits = model(idx[:, -model.hparams.block_size:])[:, -1] / max(temperature, 1e-6)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0].tolist()).decode(errors="replace")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sample":
        parser = argparse.ArgumentParser(prog="gpt.py sample", description="Generate text from a checkpoint.")
        parser.add_argument("--checkpoint", default="checkpoints", help="a checkpoint, or a directory with `latest`")
        parser.add_argument("--prompt", default="\n")
        parser.add_argument("--length", type=int, default=300)
        parser.add_argument("--temperature", type=float, default=0.8)
        parser.add_argument("--seed", type=int, default=0)
        a = parser.parse_args(sys.argv[2:])
        print(sample(a.checkpoint, a.prompt, a.length, a.temperature, a.seed))
    else:
        main(TextGPT, TextData)
