"""Hugging Face causal language models as a ready ``TrainModule``: ``--model trainkit.hf.CausalLM``.

    trainkit fit --model trainkit.hf.CausalLM --model.config '{"model_type": "llama", "hidden_size": 64, ...}'
    trainkit fit --model trainkit.hf.CausalLM --model.pretrained path/to/local/dir

The model is built with ``transformers`` (an optional dependency: ``pip install transformers``) from a config (a
dict with ``model_type``, or a path to a ``config.json`` or a directory holding one) or loaded from a local
directory, in ``configure_model``: under a strategy that builds on meta it is built there, and each rank allocates
only the tensors it keeps, initialised as ``from_config`` initialises them in one process, or read from the
directory's safetensors files one tensor (or one slice) at a time (``SafetensorsReader``); outside a Trainer, call
``configure_model()`` once before using the module. Its tensor-parallel plan is the model's own
(``config.base_model_tp_plan``; see ``trainkit_strategies/tensor/huggingface.py``), so ``--trainer.strategy parallel
--trainer.strategy.tp 2`` needs no plan written. A batch is ``(input_ids, labels)``, labels already shifted
(``TextData`` here: a text file as bytes or through a tokenizer; the demo's Markov windows); the loss is the mean
cross-entropy over the labels' tokens (``-100`` ignored).
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from trainkit.data import DataModule, check_batch_size
from trainkit.module import TrainModule
from trainkit.optim import warmup_cosine
from trainkit.parallel import positions

IGNORE = -100


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ImportError("trainkit.hf needs Hugging Face transformers: pip install transformers") from err
    return transformers


def build_config(config: dict[str, Any] | str) -> Any:
    """A ``PretrainedConfig`` from a dict (with ``model_type``), a ``config.json`` or a directory holding one."""
    transformers = _transformers()
    if isinstance(config, str):
        path = Path(config)
        if path.is_dir():
            return transformers.AutoConfig.from_pretrained(str(path))
        config = json.loads(path.read_text())
    options = dict(config)
    model_type = options.pop("model_type", None)
    if model_type is None:
        raise ValueError("trainkit.hf.CausalLM config needs a model_type (llama, mistral, qwen2, gpt2, ...).")
    return transformers.AutoConfig.for_model(model_type, **options)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_CHUNK = 2**24  # bytes read at once


class SafetensorsReader:
    """A ``save_pretrained`` directory's tensors by name, read one at a time (or one slice), never the whole
    checkpoint: one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. ``prefix``: what the
    module calls the model (``model.``), dropped from the names asked for; ``base``: the model's
    ``base_model_prefix``, tried too (a file saved from the base model has names without it).

    Rows are read with ``readinto`` (pread) through a 16 MiB buffer, not through safetensors' memory map: the pages
    of a mapped file stay resident while it is mapped, so a 3 GB tensor read through the map adds 3 GB to the
    rank's peak beside the tensor it fills; read this way a rank holds its part plus 16 MiB."""

    def __init__(self, directory: str, prefix: str = "", base: str = "") -> None:
        root = Path(directory)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (root / "model.safetensors").is_file():
            self.files = dict.fromkeys(_header(root / "model.safetensors")[1], root / "model.safetensors")
        else:
            raise FileNotFoundError(f"{directory} holds no model.safetensors (nor model.safetensors.index.json): "
                                    "save the model with save_pretrained(..., safe_serialization=True).")
        self.prefix, self.base = prefix, f"{base}." if base else ""
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def key(self, name: str) -> str | None:
        """The file's name for the module's tensor ``name`` (None: not in the checkpoint)."""
        if not name.startswith(self.prefix):
            return None
        name = name[len(self.prefix):]
        for key in (name, name.removeprefix(self.base), self.base + name):
            if key in self.files:
                return key
        return None

    def __call__(self, name: str, out: Tensor, index: tuple | None = None) -> bool:
        """Write the tensor ``name`` (its part ``index``: slices, one a dimension) into ``out``, rows at a time;
        False where the checkpoint has no such tensor."""
        key = self.key(name)
        if key is None:
            return False
        path = self.files[key]
        if path not in self._headers:
            self._headers[path] = _header(path)
        start, entries = self._headers[path]
        entry = entries[key]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        begin = start + entry["data_offsets"][0]
        index = tuple(index) if index is not None else (slice(None),)
        rows = index[0]
        with open(path, "rb", buffering=0) as f, torch.no_grad():
            if not shape or not isinstance(rows, slice) or rows.step not in (None, 1):  # a scalar, or rows picked
                out.copy_(_read(f, begin, dtype, shape)[index if shape else ()])
                return True
            first, stop, _ = rows.indices(shape[0])
            row_bytes = torch.Size(shape[1:]).numel() * dtype.itemsize
            per_read = max(1, _CHUNK // max(1, row_bytes))
            for lo in range(first, stop, per_read):
                hi = min(stop, lo + per_read)
                block = _read(f, begin + lo * row_bytes, dtype, [hi - lo, *shape[1:]])
                out[lo - first : hi - first].copy_(block[(slice(None), *index[1:])])
        return True


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data starts, and its header's entries (name -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(size))
    entries.pop("__metadata__", None)
    return 8 + size, entries


def _read(f: Any, offset: int, dtype: torch.dtype, shape: list[int]) -> Tensor:
    """``shape`` elements of ``dtype`` at byte ``offset`` of the open file ``f``, read into a fresh tensor."""
    block = torch.empty(shape, dtype=dtype)
    view, done = memoryview(block.view(-1).view(torch.uint8).numpy()), 0
    while done < len(view):
        read = os.preadv(f.fileno(), [view[done:]], offset + done)
        if read <= 0:
            raise OSError(f"{f.name} ends before the tensor at byte {offset} does: the file is truncated.")
        done += read
    return block


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens every ``stride``: ``(input_ids, labels)`` shifted by one."""

    def __init__(self, tokens: Tensor, block_size: int, stride: int) -> None:
        if tokens.numel() <= block_size:
            raise ValueError(f"The text has {tokens.numel()} tokens, too few for one window of {block_size} + 1: use "
                             "a longer text or a smaller --data.block_size.")
        self.tokens, self.block_size, self.stride = tokens, block_size, stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        window = self.tokens[i * self.stride : i * self.stride + self.block_size + 1]
        return window[:-1], window[1:]


class TextData(DataModule):
    """A text file as tokens for a causal language model: the first ``1 - val_fraction`` for training, the rest for
    validation.

    Args:
        path: the text file (UTF-8).
        tokenizer: a local directory ``AutoTokenizer.from_pretrained`` loads (its vocabulary must fit the model's
            ``vocab_size``); None: the file's bytes (vocabulary 256), as ``examples/gpt.py`` reads text.
        block_size: tokens per example. stride: tokens between the starts of training windows (default
            ``block_size / 2``). val_fraction: share held out. batch_size: per-rank batch size.
    """

    def __init__(self, path: str, tokenizer: str | None = None, block_size: int = 128, stride: int | None = None,
                 val_fraction: float = 0.1, batch_size: int = 8, num_workers: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}.")
        self.path, self.tokenizer, self.block_size, self.val_fraction = Path(path), tokenizer, block_size, val_fraction
        self.stride = stride or max(1, block_size // 2)
        self.batch_size, self.num_workers = check_batch_size(batch_size), num_workers
        self._splits: dict[str, Tensor] = {}

    def tokens(self) -> Tensor:
        if not self.path.is_file():
            raise FileNotFoundError(f"--data.path {self.path} is not a file.")
        if self.tokenizer is None:
            return torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8).long()
        tokenizer = _transformers().AutoTokenizer.from_pretrained(self.tokenizer)
        return torch.tensor(tokenizer(self.path.read_text())["input_ids"], dtype=torch.long)

    def setup(self, stage: str) -> None:
        if not self._splits:
            data = self.tokens()
            cut = int(data.numel() * (1 - self.val_fraction))
            self._splits = {"train": data[:cut], "val": data[cut:]}

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return DataLoader(TokenWindows(self._splits["train"], self.block_size, self.stride), batch_size=self.batch_size,
                          shuffle=True, drop_last=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(TokenWindows(self._splits["val"], self.block_size, self.block_size),
                          batch_size=self.batch_size, num_workers=self.num_workers)


def _positions(rotary: nn.Module, attention: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Rotary position embeddings for an attention module called without them (a pipeline stage's), from the length
    of the sequence it attends over."""
    if kwargs.get("position_embeddings") is not None:
        return None
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    ids = positions(hidden.shape[-2], hidden.device).unsqueeze(0)
    return args, {**kwargs, "position_embeddings": rotary(hidden, position_ids=ids)}


class _Embed(nn.Module):
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = base.embed_tokens

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)


class _Layer(nn.Module):
    """A decoder layer called with the hidden states alone (causal attention, positions from its attention hook)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Tensor) -> Tensor:
        out = self.layer(hidden, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))


class CausalLM(TrainModule):
    """A Hugging Face causal language model trained on next-token prediction.

    Args:
        config: the model's configuration (a dict with ``model_type``, or a path to a config.json or its directory);
            the weights start from the model's own initialisation, seeded by the run.
        pretrained: a local directory saved by ``save_pretrained`` (its config and safetensors weights); instead of
            ``config``. Each rank reads only the tensors it keeps, one at a time.
        lr, weight_decay, warmup_steps, max_steps, adam_eps: AdamW (betas 0.9, 0.95) with linear warmup and cosine
            decay to 10%; norms, biases and embeddings without weight decay.
        attn_implementation: Hugging Face's attention kernel ("sdpa", "eager").
    """

    def __init__(self, config: dict[str, Any] | str | None = None, pretrained: str | None = None, lr: float = 3e-4,
                 weight_decay: float = 0.1, warmup_steps: int = 100, max_steps: int = 2000, adam_eps: float = 1e-8,
                 attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.save_hyperparameters()
        if (config is None) == (pretrained is None):
            raise ValueError("trainkit.hf.CausalLM needs exactly one of config= (a new model) or pretrained= (a local "
                             "directory to load).")
        _transformers()
        self._stage_hooks = False  # pipeline_layers() added the attention modules' position hooks

    def configure_model(self) -> None:
        """Build the model (once): on the meta device where the strategy builds there (its init context records
        transformers' initialisation, which transformers itself skips on meta, so each rank's tensors get the values
        ``from_config`` gives in one process), else on the host. ``pretrained``: the tensors come from the
        directory's files (``tensor_source``), read as they are materialised, or here when built on the host."""
        if hasattr(self, "model"):
            return
        transformers, hp = _transformers(), self.hparams
        config = build_config(hp.pretrained if hp.pretrained is not None else hp.config)
        on_meta = torch.get_default_device().type == "meta"
        initialises = mock.patch("transformers.modeling_utils.get_torch_context_manager_or_global_device",
                                 return_value=torch.device("cpu")) if on_meta else nullcontext()
        with initialises:
            self.model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=hp.attn_implementation)
        if hp.pretrained is None:
            return
        self.tensor_source = SafetensorsReader(hp.pretrained, "model.", self.model.base_model_prefix)
        if not on_meta:
            with torch.no_grad():
                for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
                    self.tensor_source(name, tensor)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    # -- pipeline stages: the embedding, each decoder layer, the final norm with the head -----------------
    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a chain of modules for ``pipeline`` and ``parallel --pp``. Between stages only the hidden
        states travel: each attention module makes its rotary position embeddings from the length of the sequence
        it attends over (after sequence parallelism gathered it), and causal attention needs no mask."""
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        missing = [a for a in ("embed_tokens", "layers", "rotary_emb", "norm") if not hasattr(base, a)]
        if missing:
            raise TypeError(f"trainkit.hf.CausalLM cuts pipeline stages of Llama-family models (embed_tokens, layers, "
                            f"rotary_emb, norm); {type(self.model).__name__} has no {', '.join(missing)}: train it "
                            "without pipeline stages (tp, cp, dp_shard and dp_replicate all work).")
        if not self._stage_hooks:
            for layer in base.layers:
                layer.self_attn.register_forward_pre_hook(partial(_positions, base.rotary_emb), with_kwargs=True)
            self._stage_hooks = True
        return [_Embed(base), *(_Layer(layer) for layer in base.layers), _Head(base.norm, self.model.lm_head)]

    def pipeline_loss(self, logits: Tensor, batch: tuple[Tensor, Tensor]) -> dict[str, Any]:
        return {"loss": self._loss(logits, batch[1]), "num_items": (batch[1] != IGNORE).sum()}

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = self._loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return {"loss": loss, "num_items": (y != IGNORE).sum()}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self._loss(self(x), y), prog_bar=True, sync_dist=True, batch_size=x.shape[0])

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "embed" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=hp.lr, betas=(0.9, 0.95),
                                      eps=hp.adam_eps)
        scheduler = warmup_cosine(optimizer, self.hparams.warmup_steps, self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
