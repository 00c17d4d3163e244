"""A tiny character-level GPT trained on Python's own standard-library sources.

Data: a fixed list of pure-Python modules from the running interpreter's standard library
(``os.py``, ``textwrap.py``, ...; see ``CORPUS_FILES``) is read from disk, concatenated
and capped at ``max_chars`` bytes. Nothing is downloaded. Tokens are raw UTF-8 bytes, so
the vocabulary is always 256 and never depends on the corpus. The first 90% of the corpus
is the training split, the rest validation; both are cut into consecutive windows of
``block_size`` inputs (targets: the same window shifted by one), so a training epoch
(shuffled windows) sees every byte once, about 440 batches with the defaults. The corpus
is the same on every run of a given Python version (files missing from another version
are skipped).

Model: a GPT in the nanoGPT mould: learned token and position embeddings, ``n_layer``
pre-LayerNorm blocks of causal self-attention (``F.scaled_dot_product_attention`` with
``is_causal=True``) and a GELU MLP, a final LayerNorm and a language-model head whose
weight is tied to the token embedding (``tie_weights``). The defaults (2 layers, 64 wide,
block 64) run 50 CPU steps in seconds.

Precision: the module never picks a dtype. The batch ``(x, y)`` holds int64 token ids
only (no float inputs); a precision plugin casts the parameters or runs under autocast,
and the loss is computed in FP32 from ``logits.float()``.

Logged: ``train/loss`` (each step), ``train/tokens_per_s`` (tokens of the previous batch
divided by the wall time between the starts of two consecutive training batches, so it
covers forward, backward, optimizer step and data loading), ``val/loss``.

To train on your own text, copy this file and replace ``build_corpus`` with anything that
returns a 1-D int64 tensor of token ids below ``VOCAB_SIZE`` (or change ``VOCAB_SIZE``).
From Hydra::

    _target_: amp_plugin.recipes.CharGPTRecipe
    n_layer: 4
    n_embd: 128
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from amp_plugin.checks import check_choice, check_int, check_number
from amp_plugin.fsdp import shard_for_model_parallel
from amp_plugin.lightning import pl
from amp_plugin.recipes._sampling import train_loader

__all__ = ["CORPUS_FILES", "VOCAB_SIZE", "CharGPT", "CharGPTRecipe", "build_corpus"]

VOCAB_SIZE = 256  # byte-level tokens

# Plain-source standard-library modules, read in this order. One missing on some Python
# version (pathlib.py became a package in 3.13) is skipped.
CORPUS_FILES = (
    "os.py",
    "textwrap.py",
    "string.py",
    "functools.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "enum.py",
    "argparse.py",
    "inspect.py",
    "pathlib.py",
    "typing.py",
    "random.py",
    "statistics.py",
    "fractions.py",
    "shutil.py",
    "tempfile.py",
    "logging/__init__.py",
    "subprocess.py",
    "threading.py",
    "json/decoder.py",
    "json/encoder.py",
    "csv.py",
    "difflib.py",
    "heapq.py",
    "bisect.py",
    "copy.py",
    "pprint.py",
    "tokenize.py",
    "ast.py",
    "calendar.py",
    "datetime.py",
    "decimal.py",
    "_pydecimal.py",
)


def build_corpus(max_chars: int = 1_000_000) -> torch.Tensor:
    """Concatenate ``CORPUS_FILES`` from the standard library into byte tokens.

    Args:
        max_chars: Cap on the corpus length in bytes (tokens).

    Returns:
        A 1-D int64 tensor of byte values in ``[0, 256)``, at most ``max_chars`` long.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars={max_chars!r} must be a positive int.")
    stdlib = os.path.dirname(os.__file__)
    chunks: list[bytes] = []
    total = 0
    for name in CORPUS_FILES:
        path = os.path.join(stdlib, *name.split("/"))
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_chars:
            break
    if not chunks:
        raise FileNotFoundError(
            f"None of the corpus files {CORPUS_FILES[:3]}... exist under {stdlib!r}; "
            "is this a Python installation without its standard-library sources?"
        )
    raw = b"".join(chunks)[:max_chars]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


class _Windows(Dataset):
    """Non-overlapping ``block_size`` windows of a token stream: ``(x, y)`` with ``y`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"A split of {len(tokens)} tokens is too short for block_size={block_size}; "
                "raise max_chars or lower block_size."
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> 3 x (B, n_head, T, head_dim)
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Decoder-only transformer: ``(B, T)`` int64 token ids -> ``(B, T, vocab_size)`` logits."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"Sequence length {T} exceeds block_size={self.block_size}.")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


class CharGPTRecipe(pl.LightningModule):
    """Train a tiny byte-level GPT on standard-library Python sources.

    Args:
        n_layer: Transformer blocks.
        n_head: Attention heads; must divide ``n_embd``.
        n_embd: Embedding width.
        block_size: Context length in tokens.
        batch_size: Sequences per batch.
        lr: Peak AdamW learning rate.
        max_chars: Corpus size cap in bytes; the listed files hold about 1.7 MB, so the
            default 1 MB uses the first 19 of them (on CPython 3.11).
        dropout: Dropout probability in attention, MLP and embeddings.
        weight_decay: Weight decay on matrices and embeddings (not on biases or norm gains).
        adam_eps: AdamW's epsilon. 1e-8 rounds to zero in FP16, so pure FP16 training
            (AdamW state in FP16, no master weights) divides by zero; use about 1e-4 there.
        warmup_steps: Linear warmup steps; afterwards the LR follows a cosine down to
            ``lr / 10`` over the run's estimated total steps (constant if that is unknown).
        tie_weights: Share the token embedding with the output head.
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum 0.9).
    """

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        block_size: int = 64,
        batch_size: int = 32,
        lr: float = 3e-3,
        max_chars: int = 1_000_000,
        dropout: float = 0.0,
        weight_decay: float = 0.1,
        adam_eps: float = 1e-8,
        warmup_steps: int = 20,
        tie_weights: bool = True,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        for name, value in (
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
            ("block_size", block_size),
            ("batch_size", batch_size),
            ("max_chars", max_chars),
        ):
            check_int(name, value, ge=1)
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}.")
        check_number("lr", lr, gt=0)
        check_number("dropout", dropout, ge=0, lt=1)
        check_number("weight_decay", weight_decay, ge=0)
        check_number("adam_eps", adam_eps, gt=0)
        check_int("warmup_steps", warmup_steps, ge=0)
        if not isinstance(tie_weights, bool):
            raise TypeError(f"tie_weights={tie_weights!r} is not allowed: tie_weights must be true or false.")
        check_choice("optimizer", optimizer, ("adamw", "sgd"))
        self.save_hyperparameters()
        self.model = CharGPT(VOCAB_SIZE, block_size, n_layer, n_head, n_embd, dropout, tie_weights)
        self._splits: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last_batch_start: float | None = None
        self._last_batch_tokens = 0

    @override
    def configure_model(self) -> None:
        # strategy=fsdp (Lightning's ModelParallelStrategy): one FSDP2 unit per transformer block.
        shard_for_model_parallel(self, self.model, units=list(self.model.blocks))

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    # ----------------------------------------------------------------------------- data

    @override
    def setup(self, stage: str) -> None:
        if self._splits is None:
            tokens = build_corpus(self.hparams.max_chars)
            n_train = int(0.9 * len(tokens))
            self._splits = (tokens[:n_train], tokens[n_train:])

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return train_loader(_Windows(self._splits[0], self.hparams.block_size), self.hparams.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(
            _Windows(self._splits[1], self.hparams.block_size),
            batch_size=self.hparams.batch_size,
            shuffle=False,
            num_workers=0,
        )

    # ---------------------------------------------------------------------------- steps

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        now = time.perf_counter()
        if self._last_batch_start is not None:
            tokens_per_s = self._last_batch_tokens / max(now - self._last_batch_start, 1e-9)
            self.log("train/tokens_per_s", tokens_per_s, on_step=True, prog_bar=True)
        self._last_batch_start, self._last_batch_tokens = now, batch[0].numel()
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        return loss

    @override
    def on_validation_end(self) -> None:
        # Validation time between two training batches is not training throughput.
        self._last_batch_start = None

    @override
    def on_train_epoch_start(self) -> None:
        self._last_batch_start = None

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True)

    @override
    def configure_optimizers(self):
        hp = self.hparams
        # nanoGPT's rule: decay matrices and embeddings, not biases or norm gains.
        # parameters() yields a tied weight once.
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), eps=hp.adam_eps)
        else:
            optimizer = torch.optim.SGD(groups, lr=hp.lr, momentum=0.9)
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else math.inf
        warmup = hp.warmup_steps

        def lr_factor(step: int) -> float:
            # Linear warmup, then cosine decay to lr / 10 over the run's total steps.
            if step < warmup:
                return (step + 1) / warmup
            if not math.isfinite(total) or total <= warmup:
                return 1.0
            progress = min(1.0, (step - warmup) / (total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
