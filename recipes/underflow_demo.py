"""Gradient underflow: why FP16 needs loss scaling.

The task is a linear regression without bias (``y = x @ W*.T + noise``, inputs of scale
``input_scale = 3``, unit-variance targets) whose MSE is multiplied by
``loss_weight = 5e-7`` before backward, the way a down-weighted auxiliary loss, a mean
over a huge batch or tiny-valued targets make real gradients small. The gradient w.r.t.
the predictions is ``loss_weight * 2 * residual / (batch_size * out_features)``, about
``4e-9 * residual`` with the defaults, and the FP32 weight gradients sit around ``1e-7``.
FP16's smallest subnormal is ``6e-8``: anything below ``3e-8`` rounds to zero, so the
prediction gradient underflows unless a residual exceeds about 7, and with it every
gradient behind it.

The SGD learning rate ``lr = 5e4`` compensates: each step contracts the error by about
``lr * loss_weight * 2 / out_features * input_scale**2 = 0.11``. It is kept below FP16's
largest value (65504) so that even pure FP16 SGD, which applies ``-lr`` as an FP16 scalar,
runs instead of failing.

Expected outcome (``train/loss`` and ``val/loss`` are the *unweighted* MSE, so every run
reads on the same scale: about 1.5 at the start, about 1e-4, the noise floor, at the end):

- FP32, BF16 (FP32's exponent range) and FP16 with dynamic loss scaling (2^16) and FP32
  master weights: the loss reaches the noise floor within ~50 steps, the three curves on
  top of each other. Scaling lifts the prediction gradient to ``~2.6e-4 * residual``,
  inside FP16's range; unscaling happens into FP32 master gradients, where 1e-7 is an
  ordinary number.
- FP16 without loss scaling: every gradient element is exactly zero, so the weights stay
  where they started and the loss stays flat at its initial value. Nothing warns you: no
  inf, no NaN, just a model that does not learn.
- Pure FP16 (no master weights) with a loss scale: the unscaled gradient is stored in
  FP16 again, where ~1e-7 keeps only a bit or two. It learns at first, then levels off
  near 3e-3, 30x the noise floor, as the shrinking gradients underflow once more.
  Without a loss scale it is frozen like the case above.

``gradient_zero_fraction`` measures the effect directly on one batch.

Why SGD and not Adam: Adam divides by the gradient's running RMS and so would undo the
``loss_weight`` for non-zero gradients (its ``eps=1e-8`` is not far below these
gradients and would damp them), and AdamW's weight decay moves frozen weights anyway.
Plain SGD makes ``update = lr * grad`` visible: a zero gradient is a zero update.

To adapt it, change ``loss_weight`` (smaller: more underflow; keep ``lr * loss_weight``
constant) or ``hidden_size`` (0 is a linear model, >0 adds a tanh hidden layer, which
learns more slowly). From Hydra::

    _target_: amp_plugin.recipes.UnderflowDemoRecipe
    loss_weight: 5.0e-7
    lr: 5.0e+4
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

__all__ = ["UnderflowDemoRecipe"]


class UnderflowDemoRecipe(pl.LightningModule):
    """Linear regression with a ``5e-7``-weighted loss: FP16 gradients underflow unless scaled.

    Args:
        in_features: Input dimension.
        out_features: Regression targets per sample.
        hidden_size: 0 for a linear model without bias, otherwise the width of one tanh
            hidden layer.
        n_train: Training samples.
        n_val: Validation samples.
        batch_size: Samples per batch.
        lr: SGD learning rate; ``lr * loss_weight`` is the effective step on the MSE.
        loss_weight: Factor on the MSE before backward; it sets the gradient magnitude.
        input_scale: Standard deviation of the inputs (larger: faster learning at the
            same ``lr``; the targets keep unit variance).
        momentum: SGD momentum.
        noise_std: Standard deviation of the target noise (the loss floor is its square).
        seed: Seed of the data and of the model's initial weights (independent of the
            global RNG, so every precision starts from the same weights).
    """

    def __init__(
        self,
        in_features: int = 16,
        out_features: int = 4,
        hidden_size: int = 0,
        n_train: int = 1024,
        n_val: int = 256,
        batch_size: int = 64,
        lr: float = 5e4,
        loss_weight: float = 5e-7,
        input_scale: float = 3.0,
        momentum: float = 0.0,
        noise_std: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("in_features", in_features),
            ("out_features", out_features),
            ("n_train", n_train),
            ("n_val", n_val),
            ("batch_size", batch_size),
        ):
            check_int(name, value, ge=1)
        check_int("hidden_size", hidden_size, ge=0)  # 0: a linear model
        check_number("lr", lr, gt=0)
        check_number("loss_weight", loss_weight, gt=0)
        check_number("input_scale", input_scale, gt=0)
        check_number("momentum", momentum, ge=0, lt=1)
        check_number("noise_std", noise_std, ge=0)
        check_int("seed", seed, ge=0)
        self.save_hyperparameters()
        self.model = self._build_model()
        self._data = self._make_data()  # plain attributes, not buffers: a plugin never casts them

    def _build_model(self) -> nn.Module:
        hp = self.hparams
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hp.seed)
            if hp.hidden_size == 0:
                model = nn.Linear(hp.in_features, hp.out_features, bias=False)
                first = model
            else:
                model = nn.Sequential(
                    nn.Linear(hp.in_features, hp.hidden_size),
                    nn.Tanh(),
                    nn.Linear(hp.hidden_size, hp.out_features),
                )
                first = model[0]
        with torch.no_grad():
            first.weight.div_(hp.input_scale)  # default init assumes unit-scale inputs
        return model

    def _make_data(self) -> tuple[torch.Tensor, ...]:
        hp = self.hparams
        g = torch.Generator().manual_seed(hp.seed + 1)
        # Teacher scaled so that the targets have unit variance.
        w_star = torch.randn(hp.out_features, hp.in_features, generator=g)
        w_star /= hp.input_scale * hp.in_features**0.5
        n = hp.n_train + hp.n_val
        x = hp.input_scale * torch.randn(n, hp.in_features, generator=g)
        y = x @ w_star.T + hp.noise_std * torch.randn(n, hp.out_features, generator=g)
        return x[: hp.n_train], y[: hp.n_train], x[hp.n_train :], y[hp.n_train :]

    @override
    def configure_model(self) -> None:
        # strategy=fsdp (Lightning's ModelParallelStrategy): the whole (small) model as one FSDP2 unit.
        shard_for_model_parallel(self, self.model, units=())

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, in_features)`` -> ``(B, out_features)`` predictions."""
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

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        mse = self._mse(batch)
        self.log("train/loss", mse, on_step=True, prog_bar=True)
        return self.hparams.loss_weight * mse

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._mse(batch), prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    # -------------------------------------------------------------------------- analysis

    def gradient_zero_fraction(
        self, dtype: torch.dtype = torch.float16, loss_scale: float = 1.0, batch_size: int | None = None
    ) -> float:
        """Share of parameter-gradient elements that are exactly zero on the first training batch.

        Runs one forward/backward on a copy of the model cast to ``dtype`` (inputs cast
        too), with the weighted loss multiplied by ``loss_scale``. With the defaults,
        FP16 and ``loss_scale=1`` give 1.0 (every element underflows), ``loss_scale=2**16``
        gives 0.0, and so do FP32 and BF16 at any scale.

        Args:
            dtype: Parameter and input dtype of the copy.
            loss_scale: Factor applied to the loss before backward.
            batch_size: Samples to use (default: the recipe's ``batch_size``).
        """
        n = batch_size or self.hparams.batch_size
        x, y = self._data[0][:n], self._data[1][:n]
        model = copy.deepcopy(self.model).to(dtype)
        loss = self.hparams.loss_weight * F.mse_loss(model(x.to(dtype)).float(), y.float())
        (loss * loss_scale).backward()
        grads = [p.grad.flatten() for p in model.parameters()]
        return float((torch.cat(grads) == 0).float().mean())
