"""Weight-update stagnation: why half-precision training keeps FP32 master weights.

The task is a linear regression without bias, ``y = x @ w*``, with ``x ~ N(0, 1)``. The
model starts at weights ``w0`` drawn from ``[2.25, 3.75]`` and the teacher sits a small
step away, ``w* = w0 +- (0.02 .. 0.05)`` per weight. With SGD at ``lr = 2e-3`` the
gradient is about ``2 * (w - w*)``, so each update ``lr * grad`` stays below 5e-4.
In ``[2, 4)`` FP16's spacing (ulp) is ``2^-9 = 1.95e-3``; an update smaller than half of
it, ``9.8e-4``, rounds away: ``w - lr * grad == w`` in FP16. (BF16's ulp there is
``2^-6``, so it loses the updates as well.) FP32 keeps them, and the weights close the gap
over a few hundred steps (``w - w*`` shrinks by a factor of about ``1 - 2 * lr`` per
step, the loss by ``1 - 4 * lr``).

Expected outcome:

- FP32, and FP16 with FP32 master weights: ``val/loss`` falls from about 0.02 to about
  1e-3 in 400 steps and below 1e-4 in 800; ``train/weight_error`` falls likewise. BF16
  with master weights learns too but levels off near 2e-3, the floor set by rounding its
  forward pass to 8 significant bits.
- Pure FP16/BF16 (parameters updated in place in half precision): every update is rounded
  away, the weights stay bit-identical to ``w0`` and the loss is flat. No loss scale
  helps: the gradients are healthy (about 0.1), it is the update that is too small for
  the weight.

``lost_update_fraction`` measures the effect directly on one batch. ``train/weight_error``
(RMS distance of the weights to ``w*``) is logged alongside the losses to make the
stagnation visible on its own.

To adapt it, move the weights (``weight_low``/``weight_high``) to another binade or change
``lr``: the updates are lost while ``lr * |grad| < ulp(w) / 2``. From Hydra::

    _target_: amp_plugin.recipes.StagnationDemoRecipe
    lr: 2.0e-3
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from amp_plugin.checks import check_int, check_number
from amp_plugin.fsdp import shard_for_model_parallel
from amp_plugin.lightning import pl
from amp_plugin.recipes._sampling import train_loader

__all__ = ["StagnationDemoRecipe"]


class StagnationDemoRecipe(pl.LightningModule):
    """Linear regression whose SGD updates are below half an FP16 ulp of the weights.

    Args:
        in_features: Number of weights (input dimension).
        n_train: Training samples.
        n_val: Validation samples.
        batch_size: Samples per batch.
        lr: SGD learning rate.
        momentum: SGD momentum.
        weight_low: Lower bound of the initial weights.
        weight_high: Upper bound of the initial weights.
        min_shift: Smallest distance of a teacher weight from its initial weight.
        max_shift: Largest distance of a teacher weight from its initial weight.
        seed: Seed of the data, the teacher and the initial weights (independent of the
            global RNG, so every precision starts from the same weights).
    """

    def __init__(
        self,
        in_features: int = 16,
        n_train: int = 2048,
        n_val: int = 512,
        batch_size: int = 64,
        lr: float = 2e-3,
        momentum: float = 0.0,
        weight_low: float = 2.25,
        weight_high: float = 3.75,
        min_shift: float = 0.02,
        max_shift: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("in_features", in_features),
            ("n_train", n_train),
            ("n_val", n_val),
            ("batch_size", batch_size),
        ):
            check_int(name, value, ge=1)
        check_number("lr", lr, gt=0)
        check_number("momentum", momentum, ge=0, lt=1)
        if not check_number("weight_low", weight_low) < check_number("weight_high", weight_high):
            raise ValueError(
                f"weight_low={weight_low!r} is not allowed: weight_low must be below weight_high={weight_high!r}."
            )
        if not check_number("min_shift", min_shift, ge=0) <= check_number("max_shift", max_shift):
            raise ValueError(
                f"min_shift={min_shift!r} is not allowed: min_shift must be at most max_shift={max_shift!r}."
            )
        check_int("seed", seed, ge=0)
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(seed)
        w0 = weight_low + (weight_high - weight_low) * torch.rand(in_features, generator=g)
        sign = torch.where(torch.rand(in_features, generator=g) < 0.5, -1.0, 1.0)
        shift = min_shift + (max_shift - min_shift) * torch.rand(in_features, generator=g)
        # Plain attributes, not buffers: a precision plugin never casts them.
        self.w_star = w0 + sign * shift
        n = n_train + n_val
        x = torch.randn(n, in_features, generator=g)
        y = x @ self.w_star.unsqueeze(1)  # (n, 1)
        self._data = (x[:n_train], y[:n_train], x[n_train:], y[n_train:])

        self.model = nn.Linear(in_features, 1, bias=False)
        with torch.no_grad():
            self.model.weight.copy_(w0.unsqueeze(0))

    @override
    def configure_model(self) -> None:
        # strategy=fsdp (Lightning's ModelParallelStrategy): the whole (small) model as one FSDP2 unit.
        shard_for_model_parallel(self, self.model, units=())

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, in_features)`` -> ``(B, 1)`` predictions."""
        return self.model(x)

    # ----------------------------------------------------------------------------- data

    @override
    def train_dataloader(self) -> DataLoader:
        return train_loader(TensorDataset(self._data[0], self._data[1]), self.hparams.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            TensorDataset(self._data[2], self._data[3]), batch_size=self.hparams.batch_size, num_workers=0
        )

    # ---------------------------------------------------------------------------- steps

    def _mse(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())  # FP32 loss whatever the compute dtype

    def weight_error(self) -> torch.Tensor:
        """RMS distance of the model's weights from the teacher's ``w*`` (FP32 scalar)."""
        w = self.model.weight.detach().float().flatten()
        return (w - self.w_star.to(w.device)).pow(2).mean().sqrt()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._mse(batch)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/weight_error", self.weight_error(), on_step=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._mse(batch), prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    # -------------------------------------------------------------------------- analysis

    def lost_update_fraction(self, dtype: torch.dtype = torch.float16, batch_size: int | None = None) -> float:
        """Share of weights that one SGD step leaves bit-identical when done in ``dtype``.

        Takes one plain SGD step (no momentum) on a copy of the model cast to ``dtype``,
        inputs cast too, on the first training batch. With the defaults FP16 and BF16 give
        1.0 (every update rounded away) and FP32 gives 0.0.

        Args:
            dtype: Parameter, input and update dtype of the copy.
            batch_size: Samples to use (default: the recipe's ``batch_size``).
        """
        n = batch_size or self.hparams.batch_size
        x, y = self._data[0][:n], self._data[1][:n]
        model = copy.deepcopy(self.model).to(dtype)
        before = model.weight.detach().clone()
        F.mse_loss(model(x.to(dtype)).float(), y.float()).backward()
        torch.optim.SGD(model.parameters(), lr=self.hparams.lr).step()
        return float((model.weight.detach() == before).float().mean())
