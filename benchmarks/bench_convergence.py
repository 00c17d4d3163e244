"""Does it train as well as FP32? Final loss/accuracy over seeds, with the ablations.

    python benchmarks/bench_convergence.py [--seeds 0 1 2] [--jobs 2]
    python benchmarks/bench_convergence.py --quick --out-dir /tmp/conv   # seconds (the smoke test)

Six configurations of ``MixedPrecisionPlugin`` on four recipes, each run for a fixed number
of optimizer steps per seed, then validated once:

- ``fp32``;
- ``fp16``: FP16 model, FP32 master weights, dynamic loss scaling (the default preset);
- ``bf16``: BF16 model, FP32 master weights, no scaling;
- ``fp16_autocast``: FP32 weights, FP16 compute under autocast, dynamic loss scaling;
- ablation ``fp16 no scaling``: ``fp16`` with ``scaler=None``;
- ablation ``fp16 no masters``: pure FP16 with dynamic loss scaling
  (``master_weights=False, autocast=False``). Pure FP16 AdamW needs ``adam_eps=1e-4``
  (1e-8 rounds to zero in FP16), so ``digits`` and ``char_gpt`` get it in this
  configuration only; the two demos use SGD.

On CPU half precision is emulated (``emulate="auto"``: FP32 GEMM, one rounding to the half
dtype, which is the GPU Tensor Core error model). The recipes: ``digits`` (MLP, val
accuracy), ``char_gpt`` (the recipe's default small GPT, val loss), ``underflow_demo``
(gradients around 1e-7: FP16 flushes them to zero without loss scaling) and
``stagnation_demo`` (updates below half an FP16 ulp: lost without FP32 masters). The claim
under test, from the original mixed-precision study: mixed precision matches FP32 within
seed noise, and each ablation fails on the demo built to expose it.

"Matches FP32" below: the difference of the means over seeds is within two pooled standard
deviations of the seeds, or within 2% of the FP32 mean (losses) / 0.5 points (accuracy).

Writes, under ``--out-dir`` (default ``benchmarks/results``): ``convergence_runs.csv`` (one
row per run), ``convergence.json`` (the summary, and every run with its per-step training
loss; ``--from-json`` re-makes the tables and plots from it) and
``convergence_<recipe>.png`` (training loss against step: the mean over seeds of a short
moving average, with the min-max band). Runs go to ``--jobs`` worker processes, one thread
each.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import csv
import json
import math
import multiprocessing
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# Recipe -> (constructor kwargs, steps, metrics to report -> True where higher is better).
RECIPES: dict[str, tuple[dict[str, Any], int, dict[str, bool]]] = {
    "digits": ({}, 300, {"val/acc": True, "val/loss": False}),
    "char_gpt": ({"max_chars": 400_000}, 300, {"val/loss": False}),
    "underflow_demo": ({}, 150, {"val/loss": False}),
    "stagnation_demo": ({}, 500, {"val/loss": False, "train/weight_error": False}),
}
QUICK_RECIPES: dict[str, tuple[dict[str, Any], int, dict[str, bool]]] = {
    "digits": ({"hidden_sizes": [16], "batch_size": 32}, 4, RECIPES["digits"][2]),
    "char_gpt": (
        {
            "n_layer": 1,
            "n_head": 2,
            "n_embd": 16,
            "block_size": 16,
            "batch_size": 4,
            "max_chars": 4_000,
            "warmup_steps": 0,
        },
        4,
        RECIPES["char_gpt"][2],
    ),
    "underflow_demo": ({"n_train": 128, "n_val": 64}, 4, RECIPES["underflow_demo"][2]),
    "stagnation_demo": ({"n_train": 128, "n_val": 64}, 4, RECIPES["stagnation_demo"][2]),
}
CONFIGS = ("fp32", "fp16", "bf16", "fp16_autocast", "fp16 no scaling", "fp16 no masters")
ADAMW_RECIPES = ("digits", "char_gpt")


def make_plugin(config: str):
    from amp_plugin import MixedPrecisionPlugin

    kwargs: dict[str, Any] = {
        "fp32": dict(precision="fp32"),
        "fp16": dict(precision="fp16"),
        "bf16": dict(precision="bf16"),
        "fp16_autocast": dict(precision="fp16", master_weights=False, autocast=True),
        "fp16 no scaling": dict(precision="fp16", scaler=None),
        "fp16 no masters": dict(precision="fp16", master_weights=False, autocast=False),
    }[config]
    return MixedPrecisionPlugin(**kwargs)


def make_recipe(recipe: str, seed: int, overrides: dict[str, Any], config: str):
    import amp_plugin.recipes as r

    cls = {
        "digits": r.DigitsRecipe,
        "char_gpt": r.CharGPTRecipe,
        "underflow_demo": r.UnderflowDemoRecipe,
        "stagnation_demo": r.StagnationDemoRecipe,
    }[recipe]
    kwargs = dict(overrides)
    if recipe in ("underflow_demo", "stagnation_demo"):
        kwargs["seed"] = seed  # the demos seed their data and initial weights themselves
    if config == "fp16 no masters" and recipe in ADAMW_RECIPES:
        kwargs["adam_eps"] = 1e-4
    return cls(**kwargs)


def _init_worker() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def run_one(recipe: str, config: str, seed: int, steps: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration for ``steps`` steps on one seed; validate once at the end."""
    import logging

    from amp_plugin.lightning import pl

    Logger = pl.loggers.logger.Logger

    logging.getLogger(pl.__name__).setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class _Curve(Logger):
        """Keeps every logged scalar in memory."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[str, list[tuple[int, float]]] = {}

        @property
        def name(self) -> str:
            return "curve"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            for key, value in metrics.items():
                self.rows.setdefault(key, []).append((int(step or 0), float(value)))

    _init_worker()
    pl.seed_everything(seed, verbose=False)
    module = make_recipe(recipe, seed, overrides, config)
    plugin = make_plugin(config)
    curve = _Curve()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=curve,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        plugins=[plugin],
    )
    t0 = time.perf_counter()
    error = None
    val: dict[str, float] = {}
    try:
        trainer.fit(module)
        trainer.limit_val_batches = 1.0
        val = {k: float(v) for k, v in trainer.validate(module, verbose=False)[0].items()}
    except Exception as err:  # a diverged run is a result, not a crash of the benchmark
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    seconds = time.perf_counter() - t0
    losses = [v for _, v in curve.rows.get("train/loss", [])]
    tail = losses[-max(1, len(losses) // 10) :]
    metrics = dict(val)
    if "train/weight_error" in curve.rows:
        metrics["train/weight_error"] = curve.rows["train/weight_error"][-1][1]
    metrics["train/loss_last10pct"] = statistics.fmean(tail) if tail else math.nan
    scaler = plugin.scaler
    return {
        "recipe": recipe,
        "config": config,
        "seed": seed,
        "steps": steps,
        "seconds": round(seconds, 2),
        "skipped_steps": int(scaler.skipped_steps) if scaler is not None else 0,
        "final_scale": scaler.get_scale() if scaler is not None else None,
        "error": error,
        "metrics": metrics,
        "train_loss": losses,
    }


# ---------------------------------------------------------------------------------- summary
def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def matches(metric: str, cfg: tuple[float, float], ref: tuple[float, float]) -> bool:
    (m, s), (m0, s0) = cfg, ref
    if math.isnan(m) or math.isnan(m0):
        return False
    tolerance = 0.005 if metric.endswith("acc") else 0.02 * abs(m0)
    return abs(m - m0) <= max(2 * math.sqrt((s**2 + s0**2) / 2), tolerance)


def summarize(
    runs: list[dict[str, Any]],
    recipes: dict[str, tuple[dict[str, Any], int, dict[str, bool]]],
    configs: tuple[str, ...] = CONFIGS,
) -> dict[str, dict[str, dict[str, Any]]]:
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for recipe, (_, _, metrics) in recipes.items():
        by_config = {c: [r for r in runs if r["recipe"] == recipe and r["config"] == c] for c in configs}
        if not any(by_config.values()):
            continue
        summary[recipe] = {}
        for config, rs in by_config.items():
            row: dict[str, Any] = {
                "seeds": len(rs),
                "errors": sum(r["error"] is not None for r in rs),
                "skipped_steps": max((r["skipped_steps"] for r in rs), default=0),
            }
            for metric in metrics:
                row[metric] = _mean_std([r["metrics"].get(metric, math.nan) for r in rs])
            summary[recipe][config] = row
        for row in summary[recipe].values():
            row["matches_fp32"] = all(matches(m, row[m], summary[recipe]["fp32"][m]) for m in metrics)
    return summary


def _cell(metric: str, ms: tuple[float, float]) -> str:
    m, s = ms
    if math.isnan(m):
        return "diverged"
    if metric.endswith("acc"):
        return f"{100 * m:.1f} ± {100 * s:.1f}%"
    return f"{m:.3g} ± {s:.2g}"


def table(recipe: str, rows: dict[str, dict[str, Any]], metrics: dict[str, bool]) -> str:
    head = "| config | " + " | ".join(metrics) + " | vs fp32 | matches fp32 | max skipped steps |"
    lines = [head, "|---|" + "---:|" * len(metrics) + "---:|:---:|---:|"]
    primary = next(iter(metrics))
    ref = rows["fp32"][primary][0]
    for config, row in rows.items():
        m = row[primary][0]
        if primary.endswith("acc"):
            versus = f"{100 * (m - ref):+.1f} pt"
        else:
            versus = f"{m / ref:.2f}x" if ref and not math.isnan(m) else "-"
        cells = " | ".join(_cell(k, row[k]) for k in metrics)
        note = f" ({row['errors']} failed)" if row["errors"] else ""
        lines.append(
            f"| {config}{note} | {cells} | {versus} | {'yes' if row['matches_fp32'] else 'no'} "
            f"| {row['skipped_steps']} |"
        )
    return "\n".join(lines)


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(recipe: str, runs: list[dict[str, Any]], path: Path, configs: tuple[str, ...] = CONFIGS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    window = 1
    for config in configs:
        curves = [r["train_loss"] for r in runs if r["recipe"] == recipe and r["config"] == config and r["train_loss"]]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        window = max(1, n // 60)
        cols = list(zip(*(_smooth(c[:n], window) for c in curves)))
        mean = [statistics.fmean(col) for col in cols]
        style = "--" if config.startswith("fp16 no") else "-"
        (line,) = ax.plot(range(1, n + 1), mean, style, label=config, linewidth=1.3)
        ax.fill_between(
            range(1, n + 1),
            [min(c) for c in cols],
            [max(c) for c in cols],
            color=line.get_color(),
            alpha=0.15,
            linewidth=0,
        )
    if recipe != "char_gpt":  # losses that fall by orders of magnitude
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss" + (" (unweighted MSE)" if recipe == "underflow_demo" else ""))
    ax.set_title(f"{recipe}: mean over seeds of a {window}-step moving average, band = min..max", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=None, help="override every recipe's step count")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 4 steps, 1 seed, in-process")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where to write CSV/JSON/PNG (default benchmarks/results; --quick: nothing)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="re-make the tables and plots from a saved convergence.json instead of training",
    )
    args = parser.parse_args()
    recipes = QUICK_RECIPES if args.quick else RECIPES
    if args.quick:
        args.seeds, args.jobs = args.seeds[:1], 1
    out_dir = args.out_dir if args.out_dir is not None else (None if args.quick else RESULTS)
    recipes = {k: v for k, v in recipes.items() if k in args.recipes}
    configs = tuple(c for c in CONFIGS if c in args.configs)
    if "fp32" not in configs:
        parser.error("--configs must include fp32 (the reference)")

    command = "python benchmarks/bench_convergence.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    t0 = time.perf_counter()
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        runs = [r for r in saved["runs"] if r["recipe"] in recipes and r["config"] in configs]
        args.seeds = saved["meta"]["seeds"]
        args.jobs = saved["meta"].get("jobs", args.jobs)
        command = saved["meta"]["command"]
        elapsed = saved["meta"]["seconds"]
        steps_by_recipe = saved["meta"]["steps"]
    else:
        tasks = [
            (recipe, config, seed, args.steps or steps, overrides)
            for recipe, (overrides, steps, _) in recipes.items()
            for seed in args.seeds
            for config in configs
        ]
        if args.jobs <= 1:
            runs = [run_one(*task) for task in tasks]
        else:
            ctx = multiprocessing.get_context("spawn")
            with futures.ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_worker) as pool:
                runs = list(pool.map(run_one, *zip(*tasks)))
        elapsed = time.perf_counter() - t0
        steps_by_recipe = {k: args.steps or v[1] for k, v in recipes.items()}
    summary = summarize(runs, recipes, configs)

    print(
        f"# Convergence: seeds {args.seeds}, {len(runs)} runs, {args.jobs} job(s) x 1 thread, "
        f"torch {torch.__version__}, {elapsed:.0f} s"
    )
    print(f"command: {command.strip()}")
    for recipe, rows in summary.items():
        steps = steps_by_recipe[recipe]
        print(f"\n## {recipe} ({steps} steps, mean ± std over {len(args.seeds)} seeds)\n")
        print(table(recipe, rows, recipes[recipe][2]))
    failures = [r for r in runs if r["error"]]
    if failures:
        print("\nFailed runs:")
        for r in failures:
            print(f"- {r['recipe']} / {r['config']} / seed {r['seed']}: {r['error']}")

    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "convergence_runs.csv", "w", newline="") as f:
            metric_names = sorted({k for r in runs for k in r["metrics"]})
            writer = csv.writer(f)
            writer.writerow(
                ["recipe", "config", "seed", "steps", "seconds", "skipped_steps", "final_scale", "error", *metric_names]
            )
            for r in runs:
                writer.writerow(
                    [
                        r["recipe"],
                        r["config"],
                        r["seed"],
                        r["steps"],
                        r["seconds"],
                        r["skipped_steps"],
                        r["final_scale"],
                        r["error"] or "",
                        *[f"{r['metrics'][k]:.6g}" if k in r["metrics"] else "" for k in metric_names],
                    ]
                )
        meta = {
            "command": command.strip(),
            "torch": torch.__version__,
            "seeds": args.seeds,
            "jobs": args.jobs,
            "steps": steps_by_recipe,
            "seconds": round(elapsed, 1),
        }
        compact = [r | {"train_loss": [float(f"{v:.5g}") for v in r["train_loss"]]} for r in runs]
        # One run per line: small, and still readable with a text editor.
        text = (
            '{"meta": '
            + json.dumps(meta)
            + ',\n"summary": '
            + json.dumps(summary)
            + ',\n"runs": [\n'
            + ",\n".join(json.dumps(r) for r in compact)
            + "\n]}\n"
        )
        (out_dir / "convergence.json").write_text(text)
        for recipe in summary:
            plot(recipe, runs, out_dir / f"convergence_{recipe}.png", configs)
        print(f"\nwrote {out_dir}/convergence_runs.csv, convergence.json, convergence_<recipe>.png")


if __name__ == "__main__":
    main()
