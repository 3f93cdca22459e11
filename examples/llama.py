"""A Llama-shaped decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) with a tensor-parallel plan,
trained on any text file byte by byte, under any strategy or layout.

    python examples/llama.py fit --data.path input.txt
    python examples/llama.py fit --data.path input.txt --trainer.devices 4 --trainer.strategy parallel \\
        --trainer.strategy.tp 2 --trainer.strategy.dp_shard 2
    python examples/llama.py fit --data.path input.txt --trainer.devices 4 --trainer.strategy parallel \\
        --trainer.strategy.pp 2 --trainer.strategy.tp 2

``tensor_parallel_plan()`` is what ``strategy="parallel"`` needs for ``tp`` > 1 (docs/parallel.md), and
``pipeline_layers()`` / ``pipeline_loss()`` what it needs for ``pp`` > 1.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import trainkit as tk
from trainkit.cli import main
from trainkit.optim import warmup_cosine
from trainkit.parallel import attention, positions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import TextData  # the byte-level text data of examples/gpt.py


@dataclass(frozen=True)
class LlamaConfig:
    """Attributes:
        vocab_size: tokens. max_seq_len: longest context (rotary tables). dim: model width. n_layers: blocks.
        n_heads: query heads. n_kv_heads: key/value heads (grouped-query attention: each serves n_heads/n_kv_heads
        query heads). hidden_dim: SwiGLU width. norm_eps: RMSNorm's epsilon. rope_theta: rotary base.
    """

    vocab_size: int = 256
    max_seq_len: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 352
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embeddings (Su et al., 2021), the rotate-half form, at the positions of the tokens seen
    (0..t-1; under context parallelism the rank's real indices)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", theta ** (-torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:  # [b, t, heads, head_dim]
        angles = torch.outer(positions(q.shape[1], q.device).float(), self.inv_freq.float())  # real indices under cp
        cos, sin = (torch.cat([f, f], -1)[None, :, None, :] for f in (angles.cos(), angles.sin()))

        def rotate(x: Tensor) -> Tensor:
            half = x.shape[-1] // 2
            turned = torch.cat([-x[..., half:], x[..., :half]], -1)
            return (x.float() * cos + turned.float() * sin).type_as(x)

        return rotate(q), rotate(k)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim ({cfg.dim}) must be divisible by n_heads ({cfg.n_heads}), and n_heads by n_kv_heads "
                             f"({cfg.n_kv_heads}).")
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.rotary = Rotary(self.head_dim, cfg.rope_theta)

    def forward(self, x: Tensor) -> Tensor:
        q = self.wq(x)
        b, t, _ = q.shape  # from the projection: under sequence parallelism x holds a slice of the sequence
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = self.rotary(q, k)
        repeat = self.n_heads // self.n_kv_heads
        k, v = (z.repeat_interleave(repeat, dim=2) for z in (k, v))
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)  # or across cp
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer, 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.dim, cfg.norm_eps), FeedForward(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # scaled init of the residual projections, as in GPT-2 and torchtitan
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class _Embed(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings

    def forward(self, tokens: Tensor) -> Tensor:
        return self.tok_embeddings(tokens)


class _Head(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h: Tensor) -> Tensor:
        return self.output(self.norm(h))


class Llama(tk.TrainModule):
    """A small Llama trained as a byte-level language model with AdamW, warmup and cosine decay.

    Args:
        vocab_size, max_seq_len, dim, n_layers, n_heads, n_kv_heads, hidden_dim: see LlamaConfig.
        lr: peak learning rate. weight_decay: on matrices, not on norms or embeddings. adam_eps: AdamW's epsilon.
        warmup_steps: linear warmup. max_steps: length of the cosine decay (to 10% of lr).
    """

    def __init__(self, vocab_size: int = 256, max_seq_len: int = 256, dim: int = 128, n_layers: int = 4,
                 n_heads: int = 4, n_kv_heads: int = 2, hidden_dim: int = 352, lr: float = 1e-3,
                 weight_decay: float = 0.1, adam_eps: float = 1e-8, warmup_steps: int = 100,
                 max_steps: int = 5000) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(LlamaConfig(vocab_size, max_seq_len, dim, n_layers, n_heads, n_kv_heads, hidden_dim))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor | int]:
        x, y = batch
        loss = self._loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss, "num_items": y.numel()}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self._loss(self(x), y), prog_bar=True, sync_dist=True, batch_size=x.shape[0])

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Megatron-style: q, k, v and the SwiGLU's two input projections split by columns (heads, hidden units),
        the attention output and the SwiGLU's output projection by rows; the embedding and the output split by
        vocabulary; the head counts divided by tp (each rank holds n_heads/tp query and n_kv_heads/tp key/value
        heads, so n_kv_heads must be divisible by tp)."""
        return {
            "model.tok_embeddings": "embedding",
            "model.layers.*.attn": "heads",
            "model.layers.*.attn.wq": "colwise",
            "model.layers.*.attn.wk": "colwise",
            "model.layers.*.attn.wv": "colwise",
            "model.layers.*.attn.wo": "rowwise",
            "model.layers.*.ffn.w1": "colwise",
            "model.layers.*.ffn.w3": "colwise",
            "model.layers.*.ffn.w2": "rowwise",
            "model.output": "lm_head",
        }

    def pipeline_layers(self) -> list[nn.Module]:
        return [_Embed(self.model), *self.model.layers, _Head(self.model)]

    def pipeline_loss(self, logits: Tensor, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor | int]:
        return {"loss": self._loss(logits, batch[1]), "num_items": batch[1].numel()}

    def pipeline_validation_step(self, logits: Tensor, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict:
        return {"val_loss": self._loss(logits, batch[1])}

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "tok_embeddings" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "tok_embeddings" not in n)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=hp.lr, betas=(0.9, 0.95),
                                      eps=hp.adam_eps)
        scheduler = warmup_cosine(optimizer, self.hparams.warmup_steps, self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


if __name__ == "__main__":
    main(Llama, TextData)
