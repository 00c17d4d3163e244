"""BF16 split masters against FP32 masters: paired seeds, the same update, different storage.

    python benchmarks/bench_split_master.py [--seeds 0 1 2] [--steps 300] [--jobs 2]

``MasterWeightOptimizer(..., master="bf16_split")`` keeps each BF16 parameter's master as the
BF16 weight (the master rounded to nearest) plus a 16-bit remainder: the masters evolve
exactly as FP32 masters do, and the model's weight is the FP32-master run's except at rare
ties (see ``amp_plugin/master_weights/_split.py``), so the two should agree. This trains
``digits`` and ``char_gpt`` (as ``bench_convergence.py`` does: ``MixedPrecisionPlugin``, a
fixed number of steps per seed, one validation at the end) in three configurations:

- ``fp32``;
- ``bf16``: the ``bf16`` preset (BF16 model, FP32 masters, weights rounded from them);
- ``bf16_split``: the same preset, the module's optimizer wrapped in
  ``MasterWeightOptimizer(..., master="bf16_split")`` (the plugin keeps a wrapper the module
  built), its LR scheduler moved to the wrapper.

Prints, per recipe, the mean and standard deviation over seeds of the validation metrics and
of the training loss over the last 10% of the steps, and the same for the paired difference
``bf16_split - bf16`` (seed by seed: the seeds' spread cancels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_convergence as conv  # next to this script

CONFIGS = ("fp32", "bf16", "bf16_split")


def _split_recipe(module: Any) -> Any:
    """``module`` with its optimizer wrapped in a split-master MasterWeightOptimizer."""
    from amp_plugin import MasterWeightOptimizer

    base = type(module)

    class Split(base):  # type: ignore[misc, valid-type]
        def configure_optimizers(self):
            out = super().configure_optimizers()
            inner = out["optimizer"] if isinstance(out, dict) else out
            wrapper = MasterWeightOptimizer(inner, master="bf16_split")
            if not isinstance(out, dict):
                return wrapper
            scheduler = out.get("lr_scheduler")
            if scheduler is not None:  # the same param groups: the schedule applies unchanged
                (scheduler["scheduler"] if isinstance(scheduler, dict) else scheduler).optimizer = wrapper
            return {**out, "optimizer": wrapper}

    Split.__name__ = Split.__qualname__ = f"{base.__name__}BF16Split"
    module.__class__ = Split
    return module


def run(recipe: str, config: str, seed: int, steps: int) -> dict[str, Any]:
    overrides = conv.RECIPES[recipe][0]
    if config == "bf16_split":
        make_recipe, make_plugin = conv.make_recipe, conv.make_plugin
        conv.make_recipe = lambda *a: _split_recipe(make_recipe(*a))
        conv.make_plugin = lambda _config: make_plugin("bf16")
        try:
            result = conv.run_one(recipe, "bf16", seed, steps, overrides)
        finally:
            conv.make_recipe, conv.make_plugin = make_recipe, make_plugin
        return {**result, "config": config}
    return conv.run_one(recipe, config, seed, steps, overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: bench_convergence's)")
    parser.add_argument("--recipes", nargs="+", default=["digits", "char_gpt"], choices=["digits", "char_gpt"])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    jobs = [
        (recipe, config, seed, args.steps or conv.RECIPES[recipe][1])
        for recipe in args.recipes
        for config in CONFIGS
        for seed in args.seeds
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run, *zip(*jobs)))
    print(
        f"# BF16 split masters vs FP32 masters; seeds {args.seeds}; "
        f"command: python benchmarks/bench_split_master.py {' '.join(sys.argv[1:])}".rstrip()
    )
    for recipe in args.recipes:
        metrics = [*conv.RECIPES[recipe][2], "train/loss_last10pct"]
        print(f"\n## {recipe}, {jobs[[j[0] for j in jobs].index(recipe)][3]} steps\n")
        print("| config | " + " | ".join(metrics) + " | errors |")
        print("|---|" + "---:|" * len(metrics) + "---|")
        for config in CONFIGS:
            rows = [r for r in runs if r["recipe"] == recipe and r["config"] == config]
            cells = []
            for metric in metrics:
                values = [r["metrics"][metric] for r in rows if metric in r["metrics"]]
                mean = statistics.fmean(values) if values else float("nan")
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                cells.append(f"{mean:.4f} ± {std:.4f}")
            errors = sum(r["error"] is not None for r in rows)
            print(f"| {config} | " + " | ".join(cells) + f" | {errors} |")
        by_seed = {(r["config"], r["seed"]): r["metrics"] for r in runs if r["recipe"] == recipe}
        cells = []
        for metric in metrics:
            diffs = [
                by_seed[("bf16_split", s)][metric] - by_seed[("bf16", s)][metric]
                for s in args.seeds
                if metric in by_seed.get(("bf16_split", s), {}) and metric in by_seed.get(("bf16", s), {})
            ]
            mean = statistics.fmean(diffs) if diffs else float("nan")
            std = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            cells.append(f"{mean:+.4f} ± {std:.4f}")
        print("| bf16_split - bf16, paired | " + " | ".join(cells) + " | |")


if __name__ == "__main__":
    main()
