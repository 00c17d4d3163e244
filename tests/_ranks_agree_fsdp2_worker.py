"""Run by lightning/test_ranks_agree.py: FSDP2 under Lightning's ``ModelParallelStrategy`` on two
CPU processes (gloo) with ``MixedPrecisionPlugin("bf16_lean")`` and ``("bf16_sr")``, which wrap
the AdamW in :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam` (FP32 shards, BF16 moment shards
rounded stochastically). The model starts from a fixed seed; ``configure_optimizers`` seeds each
rank differently (``seed_everything(BASE + global_rank)``) before the optimizer is built.

Both ranks read the same batch at each step (batch ``k`` from a generator seeded with ``k``), so
the reduce-scatter averages two equal FP32 gradients, ``(g + g) / 2 == g`` exactly, and the run
can be compared bit for bit with one process stepping the unsharded model (:func:`reference`).

Runs (``RUNS``): each preset as shipped, and two controls on ``bf16_lean`` that break what makes
the shards round as one tensor: ``local_seed`` (``shared_seed`` does not broadcast: each rank keeps
its own generator's seed) and ``offset_zero`` (every shard rounds with the bits of a tensor that
starts at its first element). Each rank writes ``OUT_DIR/rank<r>.pt``: one entry per run.

Usage: python _ranks_agree_fsdp2_worker.py OUT_DIR (Lightning starts rank 1 with the same command).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

import amp_plugin.fsdp_moments
from amp_plugin import CpuHalfEmulation, MixedPrecisionPlugin
from amp_plugin.fsdp import fully_shard_mixed
from amp_plugin.fsdp_moments import Bf16MomentsAdam

BASE = 1234
STEPS = 10
BATCH = 8
LR, WEIGHT_DECAY = 1e-3, 0.01
MOMENTS = ("exp_avg", "exp_avg_sq")
RUNS = {"bf16_lean": "bf16_lean", "bf16_sr": "bf16_sr", "local_seed": "bf16_lean", "offset_zero": "bf16_lean"}


def make_net() -> nn.Sequential:
    # the last layer has 3 rows: FSDP2 shards it unevenly (2 rows on rank 0, 1 on rank 1)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.record: dict[str, Any] = {}

    def configure_model(self) -> None:
        fully_shard_mixed(self.net, self.device_mesh["data_parallel"], self.trainer.precision_plugin)

    def training_step(self, data, batch_idx):
        x, y = batch(self.global_step)  # the same rows on both ranks
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        pl.seed_everything(BASE + self.global_rank, verbose=False)  # as `seed + rank` scripts do
        self.record["seed"] = torch.initial_seed()
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def on_train_start(self) -> None:
        self.record["init"] = [p.full_tensor().detach().clone() for p in self.parameters()]

    def on_train_end(self) -> None:  # the gathers are collectives: every rank runs them
        opt = self.trainer.optimizers[0]
        params = list(self.parameters())
        self.record["params"] = [p.full_tensor().detach().clone() for p in params]
        self.record["moments"] = [opt.state[p][k].full_tensor().clone() for p in params for k in MOMENTS]
        self.record["bf16_moments"] = [opt.moments_dtype(p) is torch.bfloat16 for p in params]
        self.record["steps"] = [float(opt.state[p]["step"]) for p in params]
        self.record["local_shapes"] = [tuple(p.to_local().shape) for p in params]
        self.record["sr"] = {k: opt.param_groups[0][k] for k in ("sr_seed", "sr_counter")}
        self.record["optimizer"] = type(opt).__name__
        self.record["emulating"] = self.trainer.precision_plugin.emulating

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(1000)), batch_size=1)


def reference(
    init: list[torch.Tensor], bf16_moments: list[bool], sr_seed: int, emulating: bool, steps: int = STEPS
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process, no sharding: the FP32 model stepped by ``Bf16MomentsAdam`` with ``sr_seed``,
    each forward and backward computed as FSDP2 under the preset's policy computes it (BF16
    parameters and activations, the LayerNorm in FP32 with a BF16 output, the FP32 gradients the
    upcast BF16 ones), under the plugin's CPU BF16 emulation if the run had it. Returns the weights
    and the moments (``exp_avg``, ``exp_avg_sq`` of each parameter)."""
    net = make_net()
    params = list(net.parameters())
    with torch.no_grad():
        for p, value in zip(params, init):
            p.copy_(value)
    opt = Bf16MomentsAdam(
        torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY),
        bf16_params=[p for p, low in zip(params, bf16_moments) if low],
        sr_seed=sr_seed,
    )
    half = torch.bfloat16
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        with CpuHalfEmulation(enabled=emulating, dtypes=(half,)):
            h = x.to(half)
            for m in net:
                if isinstance(m, nn.Linear):
                    h = F.linear(h, m.weight.to(half), m.bias.to(half))
                elif isinstance(m, nn.LayerNorm):
                    h = F.layer_norm(h.float(), m.normalized_shape, m.weight, m.bias, m.eps).to(half)
                else:
                    h = m(h)
            F.cross_entropy(h.float(), y).backward()
        opt.step()
    return [p.detach().clone() for p in params], [opt.state[p][k].clone() for p in params for k in MOMENTS]


def local_seed(seed: int | None) -> int:
    """``shared_seed`` without the broadcast."""
    return int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed


@contextmanager
def control(run: str) -> Iterator[None]:
    """What the control runs break, for the duration of their fit."""
    saved = {name: getattr(amp_plugin.fsdp_moments, name) for name in ("shared_seed", "_flat_offset")}
    if run == "local_seed":  # the seed each rank's own generator draws, not rank 0's
        amp_plugin.fsdp_moments.shared_seed = local_seed
    elif run == "offset_zero":  # every shard keyed as if it started the tensor
        amp_plugin.fsdp_moments._flat_offset = lambda p: 0
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(amp_plugin.fsdp_moments, name, value)


def main(out_dir: str) -> None:
    results: dict[str, Any] = {}
    rank = 0
    for run, preset in RUNS.items():
        torch.manual_seed(0)
        model = Sharded()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            plugins=[MixedPrecisionPlugin(preset)],
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        with control(run):
            trainer.fit(model)
        results[run] = {**model.record, "global_step": trainer.global_step}
        rank = trainer.global_rank
    torch.save(results, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
