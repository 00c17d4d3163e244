"""What each loss-scaling policy costs: skipped batches, retries, wasted passes, underflow, final loss, time.

    python benchmarks/bench_scaling_policies.py [--seeds 0 1] [--steps-scale 1.0]
    python benchmarks/bench_scaling_policies.py --init-scale 16777216 --growth-interval 10 --spike 8
    python benchmarks/bench_scaling_policies.py --init-scale 16

Policies (all FP16 with FP32 master weights, ``MixedPrecisionPlugin("fp16")``):

- ``GradScaler``: ``torch.amp.GradScaler``'s rule and defaults (2**16, x2 every 2000 clean
  steps, x0.5 on overflow), run as ``DynamicLossScaler(hysteresis=1)`` with bounds GradScaler
  never reaches: its trajectory equals GradScaler's (tests/core/test_dynamic_scaler.py);
- ``hysteresis=1``: ours with its defaults (GradScaler's rule, inside [1, 2**24]);
- ``hysteresis=2``: the DeepSpeed/Megatron default, an overflow backs off only at the second;
- ``retries=1``: an overflowing batch runs again once at half the scale before it is skipped;
- ``retries=24``: retries down to the floor (24 halvings take 2**24 to 1, ``retries_to_floor``):
  a batch runs until it fits or the scale reaches ``min_scale``;
- ``early growth``: ``early_growth_interval=5`` (grow before ``growth_interval`` once 5 clean
  steps in a row show headroom, keeping ``early_growth_margin=4`` bits below FP16's max);
- ``retries=24+early``: both.

Recipes: ``digits``, ``char_gpt`` (small), ``underflow_demo``, and ``char_gpt_spiky``: the
same ``char_gpt`` with its loss multiplied by 2**12 at a few steps (a loss spike: at the
scale of the moment its gradients overflow FP16, at a lower one they fit). Every policy runs
on the same seeds (paired: same data, same initial weights); each run trains for a fixed
number of optimizer steps, then validates once. Reported per recipe and policy: skipped
steps (batches never trained on), retries, wasted compute (forward+backward passes that
updated nothing, as a fraction of all), underflow (the fraction of the half-precision
parameters' scaled gradient elements below FP16's smallest normal, 2**-14: flushed to zero or
subnormal, mean over backward passes; parameters that get no gradient from a batch count
too, the same for every policy), the final scale (log2), the final validation loss (mean over
seeds, and the paired difference to ``GradScaler`` with its standard error) and the wall time
per run. ``--init-scale`` and ``--growth-interval`` set every policy's: a run that starts too
high and probes the overflow threshold often, or one that starts too low (``--init-scale
16``), where gradients underflow until the scale grows; ``--spike`` sets the spiky run's loss
factor.
Results: BENCHMARKS.md, "Loss scaling policies".
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

F32_TINY, F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max

POLICIES: dict[str, dict[str, Any]] = {
    "GradScaler": dict(min_scale=F32_TINY, max_scale=F32_MAX, on_min_scale="skip"),
    "hysteresis=1": dict(on_min_scale="skip"),
    "hysteresis=2": dict(hysteresis=2, on_min_scale="skip"),
    "retries=1": dict(retries=1, on_min_scale="skip"),
    "retries=24": dict(retries=24, on_min_scale="skip"),
    "early growth": dict(early_growth_interval=5, on_min_scale="skip"),
    "retries=24+early": dict(retries=24, early_growth_interval=5, on_min_scale="skip"),
}
FP16_MIN_NORMAL = 2.0**-14
SMALL_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 16, "max_chars": 60_000}
# recipe -> (recipe class name, constructor kwargs, optimizer steps, loss spikes at these steps)
RECIPES: dict[str, tuple[str, dict[str, Any], int, tuple[int, ...]]] = {
    "digits": ("DigitsRecipe", {}, 120, ()),
    "char_gpt": ("CharGPTRecipe", {**SMALL_GPT, "warmup_steps": 10}, 80, ()),
    "underflow_demo": ("UnderflowDemoRecipe", {}, 120, ()),
    "char_gpt_spiky": ("CharGPTRecipe", {**SMALL_GPT, "warmup_steps": 10}, 80, (20, 35, 50, 65)),
}
SPIKE = 2.0**12


def run_one(
    recipe: str, policy: str, seed: int, steps_scale: float, scaler_kwargs: dict[str, Any], spike: float
) -> dict[str, Any]:
    """Train one policy on one recipe and seed; validate once at the end."""
    import amp_plugin.recipes as recipes
    from amp_plugin import DynamicLossScaler, MixedPrecisionPlugin
    from amp_plugin.lightning import pl

    logging.getLogger(pl.__name__).setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    cls_name, kwargs, steps, spikes = RECIPES[recipe]
    steps = max(1, round(steps * steps_scale))
    spikes = tuple(s for s in spikes if s < steps)

    class Spikes(pl.Callback):
        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            if trainer.global_step in spikes:
                loss.mul_(spike)

    underflow: list[float] = []

    class Underflow(pl.Callback):
        """The scaled FP16 gradients' elements below FP16's smallest normal, per backward pass."""

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None and p.dtype is torch.float16]
            if grads:
                small = sum(int((g.abs() < FP16_MIN_NORMAL).sum()) for g in grads)
                underflow.append(small / sum(g.numel() for g in grads))

    pl.seed_everything(seed, verbose=False)
    kwargs = dict(kwargs)
    if cls_name == "UnderflowDemoRecipe":
        kwargs["seed"] = seed
    module = getattr(recipes, cls_name)(**kwargs)
    scaler = DynamicLossScaler(**{**POLICIES[policy], **scaler_kwargs})
    plugin = MixedPrecisionPlugin("fp16", scaler=scaler)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        plugins=[plugin],
        callbacks=[Underflow(), *([Spikes()] if spikes else [])],
    )
    t0 = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - t0
    trainer.limit_val_batches = 1.0
    val = trainer.validate(module, verbose=False)[0]
    return {
        "skipped": scaler.skipped_steps,
        "retried": scaler.retried_steps,
        "wasted": scaler.wasted_fraction,
        "underflow": statistics.fmean(underflow) if underflow else 0.0,
        "log2_scale": math.log2(scaler.get_scale()),
        "val_loss": float(val["val/loss"]),
        "seconds": seconds,
    }


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every recipe's step count")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="every policy's init_scale")
    parser.add_argument("--growth-interval", type=int, default=2000, help="every policy's growth_interval")
    parser.add_argument("--spike", type=float, default=SPIKE, help="the spiky run's loss factor")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args()
    scaler_kwargs = {"init_scale": args.init_scale, "growth_interval": args.growth_interval}
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cpu = _cpu_name()
    lines = [
        f"CPU: {cpu}; torch {torch.__version__}; 1 thread; seeds {args.seeds}; init_scale {args.init_scale:g}, "
        f"growth_interval {args.growth_interval}, spike x{args.spike:g}, steps x{args.steps_scale:g}",
        "",
    ]
    header = (
        "| recipe | policy | skipped | retried | wasted | underflow | log2 scale | val loss "
        "| vs GradScaler (paired, ±SE) | s/run |"
    )
    lines += [header, "|" + "---|" * 10]
    for recipe in args.recipes:
        results = {
            p: [run_one(recipe, p, seed, args.steps_scale, scaler_kwargs, args.spike) for seed in args.seeds]
            for p in args.policies
        }
        base = results.get("GradScaler")
        for policy, runs in results.items():
            val, _ = _mean_se([r["val_loss"] for r in runs])
            diff = "-"
            if base is not None and policy != "GradScaler":
                d, se = _mean_se([r["val_loss"] - b["val_loss"] for r, b in zip(runs, base)])
                diff = f"{d:+.4f} ± {se:.4f}"
            row = (
                f"| {recipe} | {policy} | {sum(r['skipped'] for r in runs)} | {sum(r['retried'] for r in runs)} | "
                f"{statistics.fmean(r['wasted'] for r in runs):.1%} | "
                f"{statistics.fmean(r['underflow'] for r in runs):.2%} | "
                f"{statistics.fmean(r['log2_scale'] for r in runs):.1f} | {val:.4f} | {diff} | "
                f"{statistics.fmean(r['seconds'] for r in runs):.1f} |"
            )
            lines.append(row)
            print(row, flush=True)
    lines.append("")
    lines.append(
        "skipped, retried: totals over the seeds; wasted: mean fraction of passes that updated nothing; "
        "underflow: mean fraction of scaled FP16 gradient elements below 2**-14; log2 scale: at the end (mean)."
    )
    text = "\n".join(lines)
    print()
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
