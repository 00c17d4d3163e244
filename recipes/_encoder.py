"""What the two encoder recipes (``ViTRecipe``, ``BertRecipe``) share: a pre-norm transformer
encoder with a classification head, and the Lightning plumbing of a classifier trained with AdamW at
torch's default betas.

Why these recipes exist: AdamW's defaults (``betas=(0.9, 0.999)``) give the second moment
``exp_avg_sq`` a time constant of 1000 steps, and a BF16 ``exp_avg_sq`` rounded to nearest cannot
shrink at all there. ``char_gpt`` uses ``beta2=0.95`` (a 20-step time constant), at which it can:
a recipe at torch's defaults is where that fault can show (``recipe=bert_grad_drop`` is one where
it does). Both recipes generate their data from ``seed`` (nothing is downloaded), hold 16384
distinct training samples by default (256 batches of 64 per epoch), and log ``train/loss``,
``val/loss`` and ``val/acc``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from amp_plugin.checks import check_choice, check_int, check_number
from amp_plugin.fsdp import shard_for_model_parallel
from amp_plugin.lightning import pl
from amp_plugin.recipes._sampling import train_loader

__all__ = ["POOLS", "SCHEDULES", "EncoderClassifier", "EncoderRecipe", "check_encoder_args"]

POOLS = ("cls", "mean")
SCHEDULES = ("cosine", "constant")


def check_encoder_args(
    *,
    n_layer: Any,
    n_head: Any,
    n_embd: Any,
    batch_size: Any,
    n_train: Any,
    n_val: Any,
    lr: Any,
    weight_decay: Any,
    adam_eps: Any,
    warmup_steps: Any,
    schedule: Any,
    dropout: Any,
    pool: Any,
    loss_drop_step: Any,
    loss_drop_factor: Any,
    seed: Any,
) -> None:
    """The checks of the arguments both encoder recipes take; each error names the argument."""
    for name, value in (
        ("n_layer", n_layer),
        ("n_head", n_head),
        ("n_embd", n_embd),
        ("batch_size", batch_size),
        ("n_train", n_train),
        ("n_val", n_val),
    ):
        check_int(name, value, ge=1)
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not allowed: n_embd must be divisible by n_head={n_head}.")
    check_number("lr", lr, gt=0)
    check_number("weight_decay", weight_decay, ge=0)
    check_number("adam_eps", adam_eps, gt=0)
    check_int("warmup_steps", warmup_steps, ge=0)
    check_choice("schedule", schedule, SCHEDULES)
    check_number("dropout", dropout, ge=0, lt=1)
    check_choice("pool", pool, POOLS)
    if loss_drop_step is not None:
        check_int("loss_drop_step", loss_drop_step, ge=0)
    check_number("loss_drop_factor", loss_drop_factor, gt=0)
    check_int("seed", seed, ge=0)


class _EncoderBlock(nn.Module):
    """Pre-LayerNorm block: bidirectional self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        # Written out rather than F.scaled_dot_product_attention: for these few short heads the CPU's
        # fused kernel is slower than three small batched matmuls. The softmax runs in FP32.
        scores = (q @ k.transpose(-2, -1)) * (C // self.n_head) ** -0.5  # (B, heads, T, T)
        weights = F.dropout(scores.float().softmax(dim=-1), self.dropout, self.training).to(v.dtype)
        x = x + self.proj((weights @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class EncoderClassifier(nn.Module):
    """``embed`` (any module mapping a batch to ``(B, T, n_embd)``) -> learned position embeddings
    (and a learned CLS vector in front with ``pool="cls"``) -> ``n_layer`` encoder blocks -> final
    LayerNorm -> pooled (the CLS position, or the mean over positions) -> linear head."""

    def __init__(
        self,
        embed: nn.Module,
        n_tokens: int,
        num_classes: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        pool: str,
    ) -> None:
        super().__init__()
        self.pool = pool
        self.embed = embed
        self.cls = nn.Parameter(torch.zeros(1, 1, n_embd)) if pool == "cls" else None
        self.pos = nn.Parameter(torch.zeros(1, n_tokens + (pool == "cls"), n_embd))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_EncoderBlock(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.pos, std=0.02)
        if self.cls is not None:
            nn.init.normal_(self.cls, std=0.02)
        for block in self.blocks:  # GPT-2's residual scaling, as char_gpt
            for proj in (block.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.embed(batch)  # (B, T, C)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x[:, 0] if self.pool == "cls" else x.mean(dim=1))


class EncoderRecipe(pl.LightningModule):
    """The steps, loaders and optimizer of both encoder recipes.

    A subclass saves its hyperparameters (at least those :func:`check_encoder_args` checks), sets
    ``self.model`` and implements :meth:`make_data`. Optimizer: ``torch.optim.AdamW`` with its
    default betas ``(0.9, 0.999)``, weight decay on matrices only; linear warmup over
    ``warmup_steps``, then a cosine down to ``lr / 10`` at ``trainer.max_steps``
    (``schedule="cosine"``) or the constant ``lr`` (``schedule="constant"``).

    ``loss_drop_step``: from this optimizer step on (``trainer.global_step``), the loss is multiplied
    by ``loss_drop_factor`` before backward, so every gradient shrinks by that factor at once, as when
    a loss term is down-weighted or a model has fit most of its data. Adam's update is invariant to a
    constant gradient scale only once its second moment has caught up: ``exp_avg_sq`` decays towards
    the new scale with its time constant (1000 steps at ``beta2=0.999``), and a stored moment that
    cannot shrink never does. ``train/loss`` is logged before the factor; ``None`` (the default): no drop.
    """

    model: nn.Module
    _data: tuple[torch.Tensor, ...] | None = None

    def make_data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_train, y_train, x_val, y_val)``, generated from ``hparams.seed`` alone."""
        raise NotImplementedError

    @override
    def configure_model(self) -> None:
        # strategy=fsdp (Lightning's ModelParallelStrategy): one FSDP2 unit per encoder block.
        shard_for_model_parallel(self, self.model, units=list(self.model.blocks))

    @override
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch)

    @override
    def setup(self, stage: str) -> None:
        if self._data is None:
            self._data = self.make_data()

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        assert self._data is not None
        return train_loader(TensorDataset(self._data[0], self._data[1]), self.hparams.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        assert self._data is not None
        dataset = TensorDataset(self._data[2], self._data[3])
        return DataLoader(dataset, batch_size=max(self.hparams.batch_size, 256), num_workers=0)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)  # FP32 loss whatever the compute dtype
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        drop = self.hparams.loss_drop_step
        if drop is not None and self.trainer.global_step >= drop:
            return loss * self.hparams.loss_drop_factor
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x).float()
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val/acc", (logits.argmax(dim=-1) == y).float().mean(), prog_bar=True)

    @override
    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, eps=hp.adam_eps)  # betas: torch's (0.9, 0.999)
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else math.inf
        warmup, cosine = hp.warmup_steps, hp.schedule == "cosine"

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if not cosine or not math.isfinite(total) or total <= warmup:
                return 1.0
            progress = min(1.0, (step - warmup) / (total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
