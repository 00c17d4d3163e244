"""Host work per training step: the Python calls and aten ops each precision mode issues.

    python benchmarks/host_work.py [--steps 10] [--configs NAME ...]

On a GPU a small model's step is bound by the host: the GPU waits while Python runs
Lightning's loop, the model's forward, autograd and the optimizer, and launches kernels one
by one (section 5 of BENCHMARKS.md). What a precision mode adds there shows up one for one.
This script counts that work on the CPU, where counts are exact and do not depend on a noisy
clock: the ``gpu.py`` model's structure (char_gpt, 6 layers, 8 heads, block 256 shrunk to
width 16, block 16, batch 2, so that computing costs nothing), AdamW with ``foreach=True``
as on a GPU, native half kernels (``emulate="off"``) and stock torch ops for the master-weight
step (``AMP_PLUGIN_FUSED=0``): emulation and the fused kernels are CPU-only, a GPU takes
neither. Lightning's ``16-mixed`` gets an explicit ``torch.amp.GradScaler("cpu")``, which
Lightning would otherwise swap for bf16 on a CPU. Per training step, after a few warm-up steps:

- *Python calls*: function calls ``cProfile`` sees (Lightning, the model, autograd's Python
  side, the optimizer, the precision plugin);
- *aten ops*: operators reaching the dispatcher below autograd (a ``TorchDispatchMode``
  counts them), and those that compute, i.e. are not views (each of these is at least one
  kernel launch on a GPU); ``_to_copy`` (dtype casts) among them.

The configurations are ``gpu.py``'s half-precision ones.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, installed or not
os.environ["AMP_PLUGIN_FUSED"] = "0"  # the master-weight step a GPU runs: stock torch ops

from gpu import trainer_configs as gpu_configs

from amp_plugin.lightning import pl
from amp_plugin.recipes.char_gpt import CharGPTRecipe

MODEL = dict(n_layer=6, n_head=8, n_embd=16, block_size=16, batch_size=2, max_chars=20_000, warmup_steps=0)
REFERENCE = "Lightning bf16-mixed"


def _lightning_16_mixed() -> dict[str, Any]:
    MixedPrecision = pl.plugins.precision.MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


# gpu.py's half-precision configurations, with native half kernels and a CPU GradScaler
CONFIGS = {name: make for name, make in gpu_configs(emulate="off").items() if "32" not in name}
CONFIGS["Lightning 16-mixed"] = _lightning_16_mixed


class _AtenCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.computing = 0
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if not func.is_view:
            self.computing += 1
            if func is torch.ops.aten._to_copy.default:
                self.casts += 1
        return func(*args, **(kwargs or {}))


class _Count(pl.Callback):
    """Count the Python calls and aten ops of the training steps after ``warmup``."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.aten = _AtenCounter()
        self.profile = cProfile.Profile()
        self.counted = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        for optimizer in trainer.optimizers:  # AdamW's default on a GPU
            for group in optimizer.param_groups:
                group["foreach"] = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.aten.__enter__()
            self.profile.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self.warmup:
            self.counted += 1
            if self.counted == self.steps:
                self.profile.disable()
                self.aten.__exit__(None, None, None)


def count(make_trainer_kwargs, steps: int = 10, warmup: int = 5) -> dict[str, float]:
    """Per-step Python calls, aten ops, computing (non-view) aten ops and casts of one configuration."""
    pl.seed_everything(0, verbose=False)
    counter = _Count(warmup, steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[counter],
        **make_trainer_kwargs(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(CharGPTRecipe(**MODEL))
    if counter.counted != steps:
        raise RuntimeError(f"counted {counter.counted} steps, expected {steps}")
    calls = sum(stat[1] for stat in pstats.Stats(counter.profile).stats.values())
    return {
        "python_calls": calls / steps,
        "aten_ops": counter.aten.ops / steps,
        "computing_ops": counter.aten.computing / steps,
        "casts": counter.aten.casts / steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps counted per configuration")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME")
    args = parser.parse_args()
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    for logger in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    torch.set_num_threads(1)

    results = {name: count(CONFIGS[name], args.steps) for name in args.configs}
    print(
        f"# Host work per training step: char_gpt {MODEL['n_layer']} layers, {MODEL['n_head']} heads, width "
        f"{MODEL['n_embd']} (gpu.py's structure), AdamW foreach, {args.steps} steps counted; torch "
        f"{torch.__version__}, Lightning {pl.__version__}"
    )
    print("command: python benchmarks/host_work.py " + " ".join(sys.argv[1:]) + "\n")
    reference = results.get(REFERENCE)
    print(
        f"| config | Python calls | aten ops | computing ops | casts | calls vs {REFERENCE} "
        f"| computing ops vs {REFERENCE} |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratios = (
            (
                f"{r['python_calls'] / reference['python_calls']:.3f}x | "
                f"{r['computing_ops'] / reference['computing_ops']:.3f}x"
            )
            if reference
            else "- | -"
        )
        print(
            f"| {name} | {r['python_calls']:,.0f} | {r['aten_ops']:,.0f} | {r['computing_ops']:,.0f} "
            f"| {r['casts']:,.0f} | {ratios} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
