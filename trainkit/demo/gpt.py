"""TinyGPT (a GPT-2-shaped decoder, tied embeddings) and the TrainModule the default run uses."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainkit.module import TrainModule
from trainkit.optim import OneBitAdam, warmup_cosine
from trainkit.parallel import Colwise, attention, positions


@dataclass(frozen=True)
class GPTConfig:
    """Attributes:
        vocab_size: tokens. block_size: longest context. n_layer / n_head / n_embd: depth, heads, width.
        dropout: dropout probability in attention and MLP outputs.
        bias: biases in linear layers and layer norms (GPT-2 has them).
    """

    vocab_size: int = 16
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head}).")
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)  # shapes from here: under tensor parallelism a rank holds n_head / tp heads of the sequence
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=2))
        y = attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)  # or across cp
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` pre-norm blocks, final norm, LM head tied to the embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"Sequence of {t} tokens exceeds block_size {self.cfg.block_size}.")
        pos = positions(t, idx.device)  # 0..t-1, or under context parallelism this rank's tokens' positions
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Embed(nn.Module):
    """Pipeline stage 0 of TinyGPT: token + position embeddings (shares the model's modules)."""

    def __init__(self, model: TinyGPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop

    def forward(self, idx: Tensor) -> Tensor:
        pos = positions(idx.shape[1], idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class _Head(nn.Module):
    """The last pipeline stage of TinyGPT: final norm and the LM head (tied to the embedding)."""

    def __init__(self, model: TinyGPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class DemoGPT(TrainModule):
    """TinyGPT trained as a language model with AdamW and linear warmup + cosine decay.

    Training returns ``{"loss", "num_items"}`` (tokens), so accumulation and ranks weight by tokens.
    Validation logs ``val_loss`` over the positions whose two predecessors are in view, and, when the
    data knows its entropy rate ``H`` (MarkovData does), ``val_excess`` = ``val_loss - H`` in nats.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias: see GPTConfig.
        lr: peak learning rate. weight_decay: applied to matrices, not to biases/norms/embeddings.
        adam_eps: AdamW's epsilon.
        optimizer: "adamw", or "onebit_adam" (trainkit.optim.OneBitAdam: AdamW for ``freeze_step`` steps, then
            frozen variance and 1-bit compressed momentum across ddp ranks).
        freeze_step: OneBitAdam's warm-up of full AdamW steps.
        warmup_steps: linear warmup. max_steps: length of the cosine decay (to 10% of lr).
    """

    def __init__(
        self, vocab_size: int = 16, block_size: int = 64, n_layer: int = 2, n_head: int = 4, n_embd: int = 64,
        dropout: float = 0.0, lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 50,
        max_steps: int = 2000, bias: bool = True, adam_eps: float = 1e-8,
        optimizer: Literal["adamw", "onebit_adam"] = "adamw", freeze_step: int = 400,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias))
        self.entropy_rate: float | None = None
        self._started = 0.0

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        vocab = getattr(data, "vocab_size", None)
        if vocab is not None and vocab > self.hparams.vocab_size:
            raise ValueError(f"The data has {vocab} tokens but the model's vocab_size is "
                             f"{self.hparams.vocab_size}; pass --model.vocab_size {vocab}.")
        self.entropy_rate = getattr(data, "entropy_rate", None)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor | int]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss, "num_items": y.numel()}

    def _eval_metrics(self, logits: Tensor, targets: Tensor, prefix: str) -> tuple[dict[str, Tensor], int]:
        """The metrics and the number of positions they average over."""
        # position i predicts token i+1 from tokens <= i: the order-2 context is complete from i >= 1 (the positions
        # are the tokens' own: under context parallelism a rank holds two chunks of the sequence)
        b, t = logits.shape[:2]
        counted = int((positions(t) >= 1).sum()) * b  # on the host: no device value is read
        complete = (positions(t, logits.device) >= 1).expand(b, t).flatten()  # a mask, not an index: no sync
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        loss = (losses * complete).sum() / counted
        metrics = {f"{prefix}_loss": loss}
        if self.entropy_rate is not None:
            metrics[f"{prefix}_excess"] = loss - self.entropy_rate
        return metrics, counted

    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> None:
        x, y = batch
        metrics, counted = self._eval_metrics(self(x), y, prefix)
        for name, value in metrics.items():  # weighted by positions: exact across ranks holding parts of sequences
            self.log(name, value, prog_bar=True, sync_dist=True, batch_size=counted)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    # parallel strategy: Megatron-style tensor parallelism (sequence-parallel where the strategy says so)
    def tensor_parallel_plan(self) -> dict[str, str | Colwise]:
        return {
            "model.wte": "embedding",  # the vocabulary split; the head tied to it is split the same way
            "model.wpe": "sequence",  # positions: under sequence parallelism each rank adds its slice
            "model.blocks.*.attn": "heads",
            "model.blocks.*.attn.qkv": Colwise(parts=3),  # q, k and v, each split by heads
            "model.blocks.*.attn.proj": "rowwise",
            "model.blocks.*.mlp.fc": "colwise",
            "model.blocks.*.mlp.proj": "rowwise",
            "model.lm_head": "lm_head",
        }

    # pipeline strategy: embeddings, the blocks, and the head as layers; the same losses as above
    def pipeline_layers(self) -> list[nn.Module]:
        return [_Embed(self.model), *self.model.blocks, _Head(self.model)]

    def pipeline_loss(self, logits: Tensor, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor | int]:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())
        return {"loss": loss, "num_items": batch[1].numel()}

    def pipeline_validation_step(self, logits: Tensor, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict:
        return self._eval_metrics(logits, batch[1], "test" if self.trainer.state == "test" else "val")[0]

    def configure_optimizers(self) -> dict:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "wte" not in n and "wpe" not in n)]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        hp = self.hparams
        if hp.get("optimizer", "adamw") == "onebit_adam":
            optimizer: torch.optim.Optimizer = OneBitAdam(groups, lr=hp.lr, betas=(0.9, 0.95), eps=hp.adam_eps,
                                                          freeze_step=hp.freeze_step)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), eps=hp.adam_eps)
        scheduler = warmup_cosine(optimizer, self.hparams.warmup_steps, self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        self._started = time.perf_counter()

    def on_fit_end(self) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        if "val_loss" not in metrics:
            return
        line = f"validation loss {metrics['val_loss']:.4f} nats"
        if self.entropy_rate is not None:
            excess = metrics["val_loss"] - self.entropy_rate
            line += f" | Markov entropy floor H = {self.entropy_rate:.4f} nats | excess {excess:.4f} nats"
        line += f" | {self.global_step} steps in {time.perf_counter() - self._started:.1f} s"
        self.print(line)
