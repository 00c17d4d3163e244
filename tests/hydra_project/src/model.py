"""A LightningModule written the way lightning-hydra-template's ``MNISTLitModule`` is: an
injected network, torchmetrics for loss and accuracy, a loss computed by ``nn.CrossEntropyLoss``
in the model's dtype, and an optimizer/scheduler built from partials."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy


class Net(nn.Module):
    def __init__(self, input_size: int = 32, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class LitClassifier(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer: Any, scheduler: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=4)
        self.val_acc = Accuracy(task="multiclass", num_classes=4)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        return loss, logits.argmax(dim=1), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BlobsDataModule(L.LightningDataModule):
    """Four Gaussian blobs in 32 dimensions, generated from a seed (nothing downloaded)."""

    def __init__(self, n: int = 512, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.hparams.seed)
        centers = torch.randn(4, 32, generator=g) * 2
        y = torch.randint(0, 4, (self.hparams.n,), generator=g)
        x = centers[y] + torch.randn(self.hparams.n, 32, generator=g)
        split = self.hparams.n * 3 // 4
        self.train_set = TensorDataset(x[:split], y[:split])
        self.val_set = TensorDataset(x[split:], y[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
