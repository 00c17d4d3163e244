"""Handwritten digits: the default recipe, small enough to train in seconds on a CPU.

Data: scikit-learn's bundled ``load_digits`` (1797 grey 8x8 images, 10 classes, shipped
inside the package, so nothing is downloaded). Pixels are scaled from 0..16 to [0, 1] and
split into train/val with a fixed, stratified split chosen by ``seed``.

Model: an MLP (``Linear -> LayerNorm -> GELU`` blocks) or a small CNN, picked with
``model="mlp"|"cnn"``. In FP32 the default MLP reaches about 97% validation accuracy
after 100 steps (a couple of seconds on one CPU thread) and 98% after 400. For the CNN,
pass channel counts such as ``hidden_sizes=[16, 32]`` (about 97% after 400 steps).

Precision: the module never picks a dtype. A precision plugin may cast the parameters to
FP16/BF16 and the float batch element ``x`` to the compute dtype (``y`` holds int64 class
ids and must stay integer), or run the step under autocast. The loss is computed in FP32
from ``logits.float()``.

To adapt it to your own classification data, copy this file and change three things:
``load_digits_split`` (return float features and int64 labels), the ``in_features`` /
``num_classes`` used to build the network, and ``_build_network``. Everything else (the
logged keys ``train/loss``, ``val/loss``, ``val/acc``, the optimizer and dataloader
plumbing) carries over. Configure it from Hydra with::

    _target_: amp_plugin.recipes.DigitsRecipe
    lr: 3.0e-3
    hidden_sizes: [128, 128]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from amp_plugin.checks import check_choice, check_int, check_number
from amp_plugin.fsdp import shard_for_model_parallel
from amp_plugin.lightning import pl
from amp_plugin.recipes._sampling import train_loader

__all__ = ["DigitsRecipe", "load_digits_split"]

_MODELS = ("mlp", "cnn")
_OPTIMIZERS = ("adamw", "sgd")


def load_digits_split(
    seed: int = 0, val_fraction: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load sklearn's digits, scale pixels to [0, 1] and split them reproducibly.

    Args:
        seed: Seed of the stratified train/val split (independent of the global RNG).
        val_fraction: Share of the 1797 samples held out for validation.

    Returns:
        ``(x_train, y_train, x_val, y_val)``: float32 images of shape ``(N, 1, 8, 8)`` and
        int64 labels of shape ``(N,)``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=val_fraction, random_state=seed, stratify=labels
    )

    def to_tensors(x, y):
        x = torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        return x, torch.as_tensor(y, dtype=torch.int64)

    return (*to_tensors(x_train, y_train), *to_tensors(x_val, y_val))


class DigitsRecipe(pl.LightningModule):
    """Classify sklearn's 8x8 digits with a small MLP or CNN.

    Args:
        lr: Peak learning rate.
        batch_size: Samples per training and validation batch.
        hidden_sizes: Widths of the MLP's hidden layers (``model="mlp"``), or the channel
            counts of the CNN's conv layers (``model="cnn"``).
        model: ``"mlp"`` or ``"cnn"``.
        optimizer: ``"adamw"`` or ``"sgd"`` (with Nesterov momentum 0.9).
        weight_decay: Decoupled weight decay (AdamW) or L2 penalty (SGD).
        adam_eps: AdamW's epsilon. 1e-8 rounds to zero in FP16, so pure FP16 training
            (AdamW state in FP16, no master weights) divides by zero; use about 1e-4 there.
        warmup_steps: Linear LR warmup from 0 to ``lr``; 0 disables the scheduler.
        val_fraction: Share of the data held out for validation.
        seed: Seed of the train/val split. Model init and shuffling follow the global seed
            (``pl.seed_everything``).
    """

    def __init__(
        self,
        lr: float = 3e-3,
        batch_size: int = 64,
        hidden_sizes: Sequence[int] = (128, 128),
        model: str = "mlp",
        optimizer: str = "adamw",
        weight_decay: float = 1e-4,
        adam_eps: float = 1e-8,
        warmup_steps: int = 0,
        val_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_number("lr", lr, gt=0)
        check_int("batch_size", batch_size, ge=1)
        sizes = list(hidden_sizes) if isinstance(hidden_sizes, Sequence) and not isinstance(hidden_sizes, str) else []
        if not sizes or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in sizes):
            raise ValueError(
                f"hidden_sizes={hidden_sizes!r} is not allowed: hidden_sizes must be a non-empty list of integers >= 1."
            )
        check_choice("model", model, _MODELS)
        check_choice("optimizer", optimizer, _OPTIMIZERS)
        check_number("weight_decay", weight_decay, ge=0)
        check_number("adam_eps", adam_eps, gt=0)
        check_int("warmup_steps", warmup_steps, ge=0)
        check_number("val_fraction", val_fraction, gt=0, lt=1)
        check_int("seed", seed, ge=0)
        hidden_sizes = sizes
        self.save_hyperparameters()
        self.hparams.hidden_sizes = hidden_sizes  # a plain list, also when Hydra passed a ListConfig
        self.net = self._build_network(model, hidden_sizes, num_classes=10)
        self._data: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def _build_network(model: str, hidden_sizes: list[int], num_classes: int) -> nn.Module:
        layers: list[nn.Module] = []
        if model == "mlp":
            layers.append(nn.Flatten())
            width = 64
            for h in hidden_sizes:
                layers += [nn.Linear(width, h), nn.LayerNorm(h), nn.GELU()]
                width = h
        else:
            channels = 1
            for i, c in enumerate(hidden_sizes):
                layers += [nn.Conv2d(channels, c, kernel_size=3, padding=1), nn.GroupNorm(1, c), nn.GELU()]
                if i == 0:
                    layers.append(nn.MaxPool2d(2))  # 8x8 -> 4x4
                channels = c
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
            width = channels
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)

    @override
    def configure_model(self) -> None:
        # strategy=fsdp (Lightning's ModelParallelStrategy): one FSDP2 unit per linear or convolution layer.
        shard_for_model_parallel(self, self.net, units=(nn.Linear, nn.Conv2d))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, 1, 8, 8)`` images in [0, 1] -> ``(B, 10)`` logits."""
        return self.net(x)

    # ----------------------------------------------------------------------------- data

    @override
    def setup(self, stage: str) -> None:
        if self._data is None:
            self._data = load_digits_split(self.hparams.seed, self.hparams.val_fraction)

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        x_train, y_train, _, _ = self._data
        return train_loader(TensorDataset(x_train, y_train), self.hparams.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        _, _, x_val, y_val = self._data
        return DataLoader(TensorDataset(x_val, y_val), batch_size=self.hparams.batch_size, num_workers=0)

    # ---------------------------------------------------------------------------- steps

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)  # FP32 loss whatever the compute dtype
        self.log("train/loss", loss, on_step=True, prog_bar=True)
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
        if hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, eps=hp.adam_eps, weight_decay=hp.weight_decay)
        else:
            optimizer = torch.optim.SGD(
                self.parameters(), lr=hp.lr, momentum=0.9, nesterov=True, weight_decay=hp.weight_decay
            )
        if hp.warmup_steps <= 0:
            return optimizer
        warmup = hp.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
