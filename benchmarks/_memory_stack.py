"""The model ``bench_memory.py`` trains and the callback that counts its training state.

``Stack``: ``depth`` blocks ``Linear(d, d) -> LayerNorm(d) -> GELU`` trained with AdamW on random
regression data, sharded per block under FSDP2 (``fsdp="ours"``: ``fully_shard_mixed``, norm layers
their own FP32 units; ``"lightning"``: plain ``fully_shard``). ``StateProbe``: the state after the last
step, gradients present, then after ``zero_grad(set_to_none=True)``, counted by
``amp_plugin.app.state_bytes.tally``; under FSDP2 also what the last block's forward gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from amp_plugin.app.state_bytes import tally
from amp_plugin.lightning import pl

__all__ = ["Block", "Stack", "StateProbe", "shape_for"]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.fc(x)))


class Stack(pl.LightningModule):
    def __init__(
        self,
        d: int,
        depth: int,
        steps: int,
        batch: int = 64,
        fsdp: str | None = None,
        fused_adamw: bool = False,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(*[Block(d) for _ in range(depth)])
        self.d, self.steps, self.batch, self.fsdp = d, steps, batch, fsdp
        self.fused_adamw = fused_adamw

    def configure_model(self) -> None:
        if self.fsdp is None:
            return
        mesh = self.device_mesh["data_parallel"]
        if self.fsdp == "ours":
            from amp_plugin.fsdp import fully_shard_mixed

            fully_shard_mixed(self.net, mesh, self.trainer.precision_plugin, units=(Block,))
        else:
            from torch.distributed.fsdp import fully_shard

            for block in self.net:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused_adamw or None)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.batch * self.steps
        x = torch.randn(n, self.d, generator=g)
        y = 0.1 * torch.randn(n, self.d, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=self.batch)


def shape_for(params_m: float, d: int) -> tuple[int, int]:
    """``(d, depth)`` for about ``params_m`` million parameters."""
    per_block = d * d + 3 * d
    return d, max(1, round(params_m * 1e6 / per_block))


class StateProbe(pl.Callback):
    """Count the state after the last step (gradients present), then after
    ``zero_grad(set_to_none=True)``; under FSDP2 also what the last block's forward holds."""

    def __init__(self) -> None:
        self.during: dict[str, int] = {}
        self.between: dict[str, int] = {}
        self.gathered = 0
        self.real_steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        if getattr(pl_module, "fsdp", None) is not None:
            # before the last norm layer runs, its block's linear layer and the norm itself are unsharded
            pl_module.net[-1].norm.register_forward_pre_hook(lambda *_: self._gathered(trainer, pl_module))

    def _gathered(self, trainer, pl_module) -> None:
        if trainer.global_step != trainer.max_steps - 1:
            return
        # Inside a forward, FSDP2 registers the unsharded parameters (plain tensors) of the
        # units in flight in place of their DTensor shards.
        seen, total = set(), 0
        for p in pl_module.parameters():
            if hasattr(p, "to_local"):
                continue
            s = p.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        self.gathered = total

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != trainer.max_steps:
            return
        self.during = tally(pl_module, trainer.optimizers)
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        self.between = tally(pl_module, trainer.optimizers)
