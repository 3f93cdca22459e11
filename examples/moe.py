"""A Mixtral-shaped mixture of experts: examples/llama.py's blocks with a ``trainkit.moe.MoE`` in place of each MLP
(top-2 of 8 SwiGLU experts by default), trained on any text file byte by byte, on one process or with its experts
divided among ranks.

    python examples/moe.py fit --data.path input.txt
    python examples/moe.py fit --data.path input.txt --trainer.devices 2 --trainer.strategy parallel \\
        --trainer.strategy.ep 2

The balance and z-losses join the objective by themselves; ``training_step`` logs the language-model loss as
``train_loss`` and what the routers did (``moe/balance_loss``, ``moe/dropped``, ``moe/tokens/expert{e}``,
``moe/imbalance``). docs/moe.md explains the options and the ``ep`` axis.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from torch import Tensor, nn

import trainkit as tk
from trainkit.cli import main
from trainkit.moe import MoE, moe_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import TextData  # the byte-level text data of examples/gpt.py
from llama import Attention, Llama, LlamaConfig, RMSNorm  # its attention, norms and training


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, moe: dict) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.ffn_norm, self.moe = RMSNorm(cfg.dim, cfg.norm_eps), MoE(cfg.dim, cfg.hidden_dim, **moe)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig, moe: dict) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # as examples/llama.py; the experts keep MoE's own initialisation
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith("wo.weight") else 0.02
                nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Mixtral(Llama):
    """A small Mixtral trained as a byte-level language model with AdamW, warmup and cosine decay: examples/llama.py's
    module (its loss, validation, pipeline stages and optimizer) over a Transformer of MoE blocks.

    Args:
        vocab_size, max_seq_len, dim, n_layers, n_heads, n_kv_heads: as examples/llama.py's.
        hidden_dim: each expert's SwiGLU width. experts, top_k: experts per layer and per token.
        scoring, capacity_factor, balance_coef, z_coef, balance, shared_hidden: ``trainkit.moe.MoE``'s.
        lr, weight_decay, adam_eps, warmup_steps, max_steps: the optimizer's, as examples/llama.py's.
    """

    def __init__(self, vocab_size: int = 256, max_seq_len: int = 256, dim: int = 128, n_layers: int = 4,
                 n_heads: int = 4, n_kv_heads: int = 2, hidden_dim: int = 176, experts: int = 8, top_k: int = 2,
                 scoring: str = "softmax", capacity_factor: float | None = None, balance_coef: float = 0.01,
                 z_coef: float = 0.001, balance: str = "sequence", shared_hidden: int = 0, lr: float = 1e-3,
                 weight_decay: float = 0.1, adam_eps: float = 1e-8, warmup_steps: int = 100,
                 max_steps: int = 5000) -> None:
        tk.TrainModule.__init__(self)  # Llama's model is not built: this one is
        self.save_hyperparameters()
        cfg = LlamaConfig(vocab_size, max_seq_len, dim, n_layers, n_heads, n_kv_heads, hidden_dim)
        self.model = Transformer(cfg, dict(experts=experts, top_k=top_k, scoring=scoring,
                                           capacity_factor=capacity_factor, balance_coef=balance_coef,
                                           z_coef=z_coef, balance=balance, shared_hidden=shared_hidden))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor | int]:
        x, y = batch
        loss = self._loss(self(x), y)  # the routers' balance and z-losses are added to the objective for us
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict(moe_metrics(self), sync_dist=True)
        return {"loss": loss, "num_items": y.numel()}

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Attention as examples/llama.py splits it; the MoE layers are not split by tp: under sequence parallelism
        each tensor-parallel rank routes its slice of the sequence (the experts divide over ``ep`` instead)."""
        return {
            "model.tok_embeddings": "embedding",
            "model.layers.*.attn": "heads",
            "model.layers.*.attn.wq": "colwise",
            "model.layers.*.attn.wk": "colwise",
            "model.layers.*.attn.wv": "colwise",
            "model.layers.*.attn.wo": "rowwise",
            "model.output": "lm_head",
        }


if __name__ == "__main__":
    main(Mixtral, TextData)
