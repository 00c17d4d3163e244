"""On a CUDA GPU: tokens/s and peak memory of a larger char_gpt, ours vs Lightning's own precisions.

    python benchmarks/gpu.py [--batch-size 64] [--warmup 10] [--steps 40] [--rounds 3] [--profile NAME ...]

Model: ``amp_plugin.recipes.CharGPTRecipe`` with 6 layers, width 512, 8 heads, block (sequence)
256, batch 64 (about 19M parameters, 16384 tokens per step), AdamW, unchanged recipe code.
Configurations, each a fresh module and ``Trainer`` on one GPU, run one after another:

- ours: ``MixedPrecisionPlugin`` ``fp32``, ``bf16`` (BF16 model, FP32 masters), ``fp16`` (FP16
  model, FP32 masters, dynamic loss scaling), ``bf16_autocast`` and ``fp16_autocast`` (FP32
  weights under ``torch.autocast``, like for like with Lightning's ``*-mixed``);
- Lightning's own: ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``; ours ``bf16_pure``
  (no masters) beside it;
- the lean presets ``bf16_lean`` (10 bytes of state per parameter) and ``bf16_sr`` (8), whose step
  off the CPU is ``fused="compiled"`` (its first step compiles, inside the warm-up).

Tokens/s: tokens of the timed steps divided by the wall time between a
``torch.cuda.synchronize()`` before the first timed step and one after the last (forward,
backward, optimizer step, data loading and Lightning's per-step work all inside);
the first ``--warmup`` steps (CUDA context, cuBLAS/cuDNN heuristics, allocator growth,
early loss-scale overflows) are excluded. Every configuration is measured ``--rounds`` times,
the configurations alternating within each round and each round starting one configuration
later, so that drifts of the machine (clocks, other tenants, the host CPU) and the order
(which configuration runs first, after which other one) hit them alike; the table shows the
median and the spread (slowest over fastest round, minus one). Peak memory:
``torch.cuda.max_memory_allocated()`` over the whole fit (weights, FP32 masters, optimizer
state, activations, gradients).

TF32 is left at PyTorch's default (``torch.backends.cuda.matmul.allow_tf32`` is False unless
something changed it; the header prints the values in effect), so ``fp32`` is true FP32.
A configuration that fails is reported in its row and the rest still run; the script
starts no new measurement after ``--budget-s`` seconds (default 240; a configuration
measured in fewer rounds says so). Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import platform
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

NO_GPU_MESSAGE = (
    "benchmarks/gpu.py measures GPU throughput and needs a CUDA device, but "
    "torch.cuda.is_available() is False here, so there is nothing to measure. "
    "Run it on a machine with an NVIDIA GPU: python benchmarks/gpu.py"
)

MODEL = dict(n_layer=6, n_head=8, n_embd=512, block_size=256)
FP32_REFERENCE = "Lightning 32-true"
BF16_LIGHTNING = "Lightning bf16-mixed"


def trainer_configs(**plugin_kwargs: Any) -> dict[str, Any]:
    """Name -> fresh Trainer kwargs; ``plugin_kwargs`` go to every ``MixedPrecisionPlugin``."""
    try:
        from amp_plugin.lightning.plugin import MixedPrecisionPlugin
    except Exception as err:  # still measure Lightning's own; our rows then show the error
        import_error = err

        def ours(**kwargs: Any):
            def fail() -> dict[str, Any]:
                raise import_error

            return fail
    else:

        def ours(**kwargs: Any):
            return lambda: {"plugins": [MixedPrecisionPlugin(**kwargs, **plugin_kwargs)]}

    def lightning(precision: str):
        return lambda: {"precision": precision}

    return {
        "ours fp32": ours(precision="fp32"),
        "ours bf16": ours(precision="bf16"),
        "ours fp16": ours(precision="fp16"),
        "ours bf16_autocast": ours(precision="bf16", master_weights=False, autocast=True),
        "ours fp16_autocast": ours(precision="fp16", master_weights=False, autocast=True),
        "ours bf16_pure": ours(precision="bf16", master_weights=False),
        "ours bf16_lean": ours(precision="bf16_lean"),
        "ours bf16_sr": ours(precision="bf16_sr"),
        "Lightning 32-true": lightning("32-true"),
        "Lightning bf16-mixed": lightning("bf16-mixed"),
        "Lightning 16-mixed": lightning("16-mixed"),
        "Lightning bf16-true": lightning("bf16-true"),
    }


def measure(
    make_module, make_trainer_kwargs, warmup: int, steps: int, cuda: bool = True, profile: bool = False
) -> dict[str, Any]:
    """Fit a fresh module for ``warmup + steps`` steps; time the last ``steps``.

    ``cuda=False`` runs the same code on the CPU without the CUDA calls (a dry run for tests).
    ``profile=True`` records the timed steps with ``torch.profiler`` and adds ``"profile"``
    (per-operator summaries, sorted by host time and, on a GPU, by device time) to the result.
    """
    from amp_plugin.lightning import pl

    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Throughput(pl.Callback):
        def __init__(self) -> None:
            self.batches = 0
            self.tokens = 0
            self.t0 = self.t1 = 0.0

            self.profiler: Any = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batches += 1
            if self.batches == warmup + 1:
                sync()
                if profile:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if cuda:
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    self.profiler = torch.profiler.profile(activities=activities)
                    self.profiler.__enter__()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.batches > warmup:
                self.tokens += batch[0].numel()
            if self.batches == warmup + steps:
                sync()
                self.t1 = time.perf_counter()
                if self.profiler is not None:
                    self.profiler.__exit__(None, None, None)

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(0, verbose=False)
    timer = Throughput()
    module = make_module()
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[timer],
        **make_trainer_kwargs(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    if timer.t1 <= timer.t0:
        raise RuntimeError(f"only {timer.batches} batches ran; need {warmup + steps}")
    seconds = timer.t1 - timer.t0
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    skipped = getattr(scaler, "skipped_steps", None)
    result = {
        "ms_per_step": seconds / steps * 1e3,
        "tokens_per_s": timer.tokens / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "skipped": skipped,
    }
    if timer.profiler is not None:
        events = timer.profiler.key_averages()
        tables = [events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)]
        if cuda:  # the host side above (what a host-bound step waits on), the device side here
            tables.append(events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))
        result["profile"] = "\n".join(tables)
    del trainer, module
    return result


def summarize(runs: list[dict[str, Any]], error: str | None, rounds: int, budget_s: float) -> dict[str, Any]:
    """One row from a configuration's rounds: median time and throughput, spread, peak memory."""
    if error is not None:
        return {"error": error}
    if not runs:
        return {"error": f"not run: over the {budget_s:.0f} s budget"}
    times = [r["ms_per_step"] for r in runs]
    return {
        "ms_per_step": statistics.median(times),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "spread": max(times) / min(times) - 1.0,
        "rounds": len(runs) if len(runs) == rounds else f"{len(runs)} of {rounds}",
        "peak_gib": max(r["peak_gib"] for r in runs),
        "skipped": runs[-1]["skipped"],
    }


def recipes_of_checkout(root: Path) -> None:
    """Make ``amp_plugin.recipes`` importable from a checkout that is not installed (an install maps
    ``recipes/`` to it; a GPU machine runs the checkout as it is)."""
    import importlib.util

    try:
        import amp_plugin.recipes  # noqa: F401
    except ModuleNotFoundError:
        init = root / "recipes" / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            "amp_plugin.recipes", init, submodule_search_locations=[str(init.parent)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["amp_plugin.recipes"] = module
        spec.loader.exec_module(module)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measure each configuration this many times, alternating; report the median",
    )
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no measurement after this")
    parser.add_argument("--configs", nargs="+", default=None, help="names to run (default: all)")
    parser.add_argument(
        "--profile",
        nargs="+",
        default=[],
        metavar="NAME",
        help="after the table, profile these configs (torch.profiler over the timed steps): "
        "operators by host time, then operators and kernels by device time",
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the same code on the CPU with a tiny model and no CUDA calls (for tests)",
    )
    args = parser.parse_args()

    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least 1")
    cuda = not args.cpu_dry_run
    if cuda and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, installed or not
    from _harness import rotated  # next to this script

    from amp_plugin.lightning import pl

    for logger in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.WARNING)  # no per-Trainer banners between rows

    recipes_of_checkout(Path(__file__).resolve().parents[1])
    from amp_plugin.recipes.char_gpt import CharGPTRecipe

    configs = trainer_configs()
    names = args.configs or list(configs)
    unknown = sorted((set(names) | set(args.profile)) - set(configs))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(configs)}")
    model = MODEL if cuda else dict(n_layer=1, n_head=2, n_embd=16, block_size=16)
    make_module = partial(
        CharGPTRecipe, **model, batch_size=args.batch_size, max_chars=1_000_000 if cuda else 20_000, warmup_steps=0
    )
    params = sum(p.numel() for p in make_module().parameters())

    print(
        f"# GPU throughput: char_gpt {model['n_layer']} layers, width {model['n_embd']}, "
        f"block {model['block_size']}, batch {args.batch_size} ({params / 1e6:.1f}M params, "
        f"{args.batch_size * model['block_size']} tokens/step), {args.warmup} warm-up + {args.steps} timed steps"
    )
    if cuda:
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        device = "CPU dry run (tiny model, no CUDA calls; the numbers mean nothing)"
    print(
        f"device: {device}, torch {torch.__version__}, Lightning {pl.__version__}, Python {platform.python_version()}"
    )
    print(
        f"TF32 at defaults: torch.backends.cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, "
        f"torch.backends.cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
        f"float32_matmul_precision={torch.get_float32_matmul_precision()!r}"
    )
    profile = "".join(f" '{name}'" for name in args.profile)
    print(
        f"command: python benchmarks/gpu.py --batch-size {args.batch_size} --warmup {args.warmup} "
        f"--steps {args.steps} --rounds {args.rounds} --budget-s {args.budget_s:g}"
        f"{' --profile' + profile if profile else ''}\n",
        flush=True,
    )

    start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    errors: dict[str, str] = {}
    for round_ in range(1, args.rounds + 1):
        for name in rotated(names, round_ - 1):
            if name in errors or time.perf_counter() - start > args.budget_s:
                continue
            try:
                runs[name].append(measure(make_module, configs[name], args.warmup, args.steps, cuda))
            except Exception as err:  # report it and carry on with the others
                errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            print(f"  round {round_}, {name}: {runs[name][-1] if name not in errors else errors[name]}", flush=True)
    results = {name: summarize(runs[name], errors.get(name), args.rounds, args.budget_s) for name in names}

    fp32 = results.get(FP32_REFERENCE, {}).get("tokens_per_s") or results.get("ours fp32", {}).get("tokens_per_s")
    bf16 = results.get(BF16_LIGHTNING, {}).get("tokens_per_s")
    print(
        "\n| config | ms/step | tokens/s | vs FP32 | vs Lightning bf16-mixed | spread | rounds | peak GiB "
        "| skipped steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | | | |")
            continue
        tps = r["tokens_per_s"]
        vs_fp32 = f"{tps / fp32:.2f}x" if fp32 else "-"
        vs_bf16 = f"{tps / bf16:.2f}x" if bf16 else "-"
        skipped = "-" if r["skipped"] is None else r["skipped"]
        print(
            f"| {name} | {r['ms_per_step']:.1f} | {tps:,.0f} | {vs_fp32} | {vs_bf16} | {r['spread']:.0%} "
            f"| {r['rounds']} | {r['peak_gib']:.2f} | {skipped} |"
        )
    if fp32 and bf16:
        print("\nGoals: half precision >= 2.5x FP32 tokens/s, and not slower than Lightning bf16-mixed")
        for name in ("ours bf16", "ours fp16", "ours bf16_autocast", "ours fp16_autocast"):
            r = results.get(name, {})
            if "tokens_per_s" in r:
                print(
                    f"- {name}: {r['tokens_per_s'] / fp32:.2f}x FP32, {r['tokens_per_s'] / bf16:.2f}x Lightning "
                    f"bf16-mixed"
                )
    ours_bf16 = results.get("ours bf16", {}).get("tokens_per_s")
    if ours_bf16:
        print("Goal: the lean presets >= 0.95x the tokens/s of ours bf16, in less memory")
        for name in ("ours bf16_lean", "ours bf16_sr"):
            r = results.get(name, {})
            if "tokens_per_s" in r:
                print(
                    f"- {name}: {r['tokens_per_s'] / ours_bf16:.2f}x ours bf16, peak "
                    f"{r['peak_gib']:.2f} GiB against {results['ours bf16']['peak_gib']:.2f} GiB"
                )
    medians = [r["ms_per_step"] for r in results.values() if "ms_per_step" in r]
    if medians:
        print(
            f"\n{len(medians)} of {len(results)} configurations measured in {time.perf_counter() - start:.0f} s "
            f"(median {statistics.median(medians):.1f} ms/step; spread: slowest over fastest round, minus one)"
        )
    for name in args.profile:
        r = measure(make_module, configs[name], args.warmup, args.steps, cuda, profile=True)
        print(
            f"\n## Profile of {name}: {r['ms_per_step']:.1f} ms/step while profiled ({args.steps} steps; "
            f"user annotations such as Optimizer.step span their whole range)\n{r['profile']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
