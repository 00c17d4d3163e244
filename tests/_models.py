"""Tiny LightningModules shared by the plugin tests, for either Lightning namespace.

The models are written once as plain classes ("bodies"); :func:`as_lightning` turns a body into a
``LightningModule`` of the namespace a test runs under (the ``pl`` fixture of ``conftest.py``), so
every plugin and callback test runs against ``lightning.pytorch`` and ``pytorch_lightning`` alike.
"""

from __future__ import annotations

import functools
import math
import tempfile
from types import ModuleType

import torch
import torch.nn.functional as F


@functools.cache
def as_lightning(pl: ModuleType, body: type) -> type:
    """``body`` as a ``pl.LightningModule`` subclass (cached, so each pair is one class)."""
    if body is PicklableClassifier:
        return _PICKLABLE[pl]
    return type(body.__name__, (body, pl.LightningModule), {"__module__": body.__module__})


def tiny_data(n: int = 64, features: int = 8, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


class TinyClassifier:
    """Linear -> LayerNorm -> ReLU -> Linear, with overflow injection at chosen global steps.

    Args:
        overflow_at: global steps whose gradient gets an inf (in ``on_after_backward``).
        optimizer: "adamw", "adamw_fused" or "sgd".
        scheduler_gamma: if set, a StepLR(step_size=1) at interval "step".
        batch_size: loader batch size.
        step_keyed: pick each batch by ``global_step`` instead of the loader's order, so a
            resumed run sees the same data as an uninterrupted one whatever Lightning's
            mid-epoch restart does with a plain DataLoader.
    """

    def __init__(
        self,
        overflow_at: tuple[int, ...] = (),
        optimizer: str = "adamw",
        lr: float = 1e-2,
        scheduler_gamma: float | None = None,
        batch_size: int = 8,
        n: int = 64,
        step_keyed: bool = False,
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        self.overflow_at = set(overflow_at)
        self.optimizer_name = optimizer
        self.lr = lr
        self.scheduler_gamma = scheduler_gamma
        self.batch_size = batch_size
        self.n = n
        self.step_keyed = step_keyed
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_keyed:
            data = tiny_data(self.n)
            rows = [(self.global_step * self.batch_size + i) % self.n for i in range(self.batch_size)]
            x, y = data[rows][0].to(x.dtype), data[rows][1]
        self.seen_dtypes.append(x.dtype)
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train/loss", loss)
        return loss

    def on_after_backward(self) -> None:
        if self.global_step in self.overflow_at:
            self.net[0].weight.grad[0, 0] = math.inf

    def configure_optimizers(self):
        params = self.parameters()
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=self.lr, fused=self.optimizer_name == "adamw_fused")
        if self.scheduler_gamma is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.scheduler_gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tiny_data(self.n), batch_size=self.batch_size)


# Where a quiet trainer's files go when a test names no directory (callbacks without a logger
# write into default_root_dir, which Lightning otherwise sets to the working directory).
_RUN_ROOT = tempfile.TemporaryDirectory(prefix="amp_plugin_tests_")


class TwoSchedules:
    """Manual optimization with two optimizers and a StepLR(step_size=1, gamma=0.5) each, stepped by the user
    after their optimizer (Lightning's manual-optimization scheduler test with two optimizers); A's gradient
    overflows at the iterations in ``overflow_at``."""

    def __init__(self, overflow_at: tuple[int, ...] = ()):
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
        self.overflow_at = set(overflow_at)
        self.iteration = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        for net, opt, sch in zip((self.a, self.b), self.optimizers(), self.lr_schedulers()):
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(net(x).float(), y))
            if net is self.a and self.iteration in self.overflow_at:
                net.weight.grad[0, 0] = math.inf
            opt.step()
            sch.step()
        self.iteration += 1

    def configure_optimizers(self):
        opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (self.a, self.b)]
        return opts, [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tiny_data(32), batch_size=8)


def quiet_trainer(pl: ModuleType, **kwargs):
    defaults = dict(
        default_root_dir=_RUN_ROOT.name,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=100,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


class PicklableClassifier(TinyClassifier):
    """``TinyClassifier`` for tests that pickle the module: its Lightning classes are module-level
    names (``PicklableClassifier_<namespace>``), which ``as_lightning`` returns for it."""


def _register_picklable() -> None:
    from amp_plugin.lightning import NAMESPACES

    for ns in NAMESPACES:
        name = f"PicklableClassifier_{ns.__name__.replace('.', '_')}"
        cls = type(name, (PicklableClassifier, ns.LightningModule), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _PICKLABLE[ns] = cls


_PICKLABLE: dict = {}
_register_picklable()
