"""End to end, per precision: step time and memory of ours in every preset vs Lightning's own.

    python benchmarks/bench_end_to_end.py [--rounds 3] [--steps 12] [--native-steps 4] [--threads 1]
    python benchmarks/bench_end_to_end.py --quick        # tiny models, seconds (the smoke test)
    python benchmarks/bench_end_to_end.py --recipes char_gpt --n-embd 256 --configs "ours fp16" "Lightning 32-true"
    python benchmarks/bench_end_to_end.py --recipes char_gpt --profile "Lightning 32-true" "ours fp16"

Two recipes, ``char_gpt`` (a small GPT: 2 layers, width 128, block 64, batch 16) and
``digits`` (the default MLP, batch 64). For each, twelve configurations:

- ours, one per precision preset of ``configs/precision/``: ``fp32``, ``fp16`` (FP32
  masters, dynamic scaler), ``bf16`` (FP32 masters), ``fp16_autocast``,
  ``bf16_autocast``, ``fp16_pure``, ``bf16_pure``; all with the defaults a user gets, so
  on CPU half precision is emulated (``emulate="auto"``: FP32 GEMM, one rounding);
- Lightning's own: ``32-true``, ``bf16-mixed``, ``16-mixed`` (with an explicit
  ``torch.amp.GradScaler("cpu")``: on CPU Lightning silently swaps ``16-mixed`` for bf16
  otherwise), ``16-true``, ``bf16-true``; these run PyTorch's native CPU half kernels.

Every configuration trains a fresh module; all use ``adam_eps=1e-4`` (the recipes' advice
for pure FP16, where 1e-8 rounds to zero; it costs nothing). Configurations alternate
within each round, so drifting machine load hits them alike, and each round starts one
configuration later: none always runs first or after the same neighbour.

Time: wall and process CPU time of each training step (forward, backward, optimizer step
and Lightning's per-step hooks; data loading excluded), median over the timed steps of all
rounds (the first ``--warmup`` steps of every fit dropped). CPU time is the steadier number
on a shared machine. The native-kernel configurations run ``--native-steps`` per round.

Memory, per configuration in a fresh subprocess (``--memory subprocess``, the default),
measured on steady-state steps (the first ones allocate the optimizer state):

- ``state MB``: bytes of the distinct tensor storages held at the start of the measured
  step (module parameters and buffers, the previous step's gradients, which Lightning
  clears just before the next backward, optimizer state, FP32 masters and their gradient
  buffers);
- ``activations MB``: bytes of the distinct storages autograd saves for backward during the
  measured step's forward (``torch.autograd.graph.saved_tensors_hooks``), and in brackets
  the part saved in FP32 (in half-precision runs: the inputs of normalisation layers, kept
  in FP32, and the FP32 loss computation);
- ``step peak MB``: the most tensor memory live during the measured step above what was
  live when it started (activations, gradients, temporaries), from the CPU allocator's
  allocation/free records (``torch.profiler``, ``profile_memory=True``): the CPU analogue
  of ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step;
- ``RSS step +MB``: how far the resident set rose during one steady-state step (another
  step than the one above, with no profiler running) over where it started: the kernel's
  peak mark ``VmHWM`` is reset at the step's start (``/proc/self/clear_refs``). It counts
  pages, not tensors: memory that glibc's allocator kept from the previous step is reused
  without a rise, and small tensors are carved out of pages already resident, so it
  under-reports and is noise below about a megabyte.

The tensor counts do not depend on the allocator, its caching or the OS; they are what a
GPU run's ``max_memory_allocated`` would see for the same tensors. ``--quick`` measures
them in-process and leaves the RSS column empty.

Results are printed as Markdown tables and saved to ``--out`` (default
``benchmarks/results/end_to_end.json``). ``--profile`` prints, instead, the ops with the most
self CPU time per step for the named configurations (where the time goes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from amp_plugin.lightning import pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import StepTimer, rotated
from _memory import MemoryProbe

from amp_plugin import MixedPrecisionPlugin
from amp_plugin.recipes import CharGPTRecipe, DigitsRecipe

RESULTS = Path(__file__).resolve().parent / "results"

RECIPES: dict[str, Callable[..., pl.LightningModule]] = {
    "char_gpt": partial(
        CharGPTRecipe,
        n_layer=2,
        n_head=4,
        n_embd=128,
        block_size=64,
        batch_size=16,
        max_chars=200_000,
        warmup_steps=0,
        adam_eps=1e-4,
    ),
    "digits": partial(DigitsRecipe, adam_eps=1e-4),
}
QUICK_RECIPES: dict[str, Callable[..., pl.LightningModule]] = {
    "char_gpt": partial(
        CharGPTRecipe,
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=16,
        batch_size=4,
        max_chars=20_000,
        warmup_steps=0,
        adam_eps=1e-4,
    ),
    "digits": partial(DigitsRecipe, hidden_sizes=(16,), batch_size=16, adam_eps=1e-4),
}


@dataclass(frozen=True)
class Config:
    name: str
    trainer_kwargs: Callable[[], dict[str, Any]]  # fresh plugin objects for every fit
    native: bool = False  # runs PyTorch's native CPU half kernels (slow): fewer steps
    counterpart: str | None = None  # the Lightning configuration in the matching mode


def _ours(**kwargs: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"plugins": [MixedPrecisionPlugin(**kwargs)]}


def _lightning(precision: str) -> Callable[[], dict[str, Any]]:
    return lambda: {"precision": precision}


def _lightning_16_mixed_cpu() -> dict[str, Any]:
    MixedPrecision = pl.plugins.precision.MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


FP32_REFERENCE = "Lightning 32-true"
CONFIGS: tuple[Config, ...] = (
    Config("ours fp32", _ours(precision="fp32"), counterpart="Lightning 32-true"),
    Config("ours fp16", _ours(precision="fp16")),
    Config("ours bf16", _ours(precision="bf16")),
    Config(
        "ours fp16_autocast",
        _ours(precision="fp16", master_weights=False, autocast=True),
        counterpart="Lightning 16-mixed (CPU GradScaler)",
    ),
    Config(
        "ours bf16_autocast",
        _ours(precision="bf16", master_weights=False, autocast=True),
        counterpart="Lightning bf16-mixed",
    ),
    Config("ours fp16_pure", _ours(precision="fp16", master_weights=False), counterpart="Lightning 16-true"),
    Config("ours bf16_pure", _ours(precision="bf16", master_weights=False), counterpart="Lightning bf16-true"),
    Config("Lightning 32-true", _lightning("32-true")),
    Config("Lightning bf16-mixed", _lightning("bf16-mixed"), native=True),
    Config("Lightning 16-mixed (CPU GradScaler)", _lightning_16_mixed_cpu, native=True),
    Config("Lightning 16-true", _lightning("16-true"), native=True),
    Config("Lightning bf16-true", _lightning("bf16-true"), native=True),
)
BY_NAME = {c.name: c for c in CONFIGS}


# ---------------------------------------------------------------------------------- timing
class CpuStepTimer(StepTimer):
    """Wall time (``times``) and process CPU time (``cpu_times``) of each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_times: list[float] = []
        self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cpu_start = time.process_time()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.cpu_times.append(time.process_time() - self._cpu_start)


def _trainer(steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        **kwargs,
    )


def _skipped(trainer: pl.Trainer) -> int:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None:
        return 0
    if isinstance(scaler, torch.amp.GradScaler):  # Lightning's 16-mixed: skipped steps are not public
        return -1
    return int(scaler.skipped_steps)


def time_config(
    make_module: Callable[[], pl.LightningModule], config: Config, steps: int, warmup: int
) -> tuple[list[float], list[float], int]:
    """Fit a fresh module for ``steps`` steps; per-step (wall, cpu) seconds after warmup, skipped steps."""
    pl.seed_everything(0, verbose=False)
    timer = CpuStepTimer()
    trainer = _trainer(steps, [timer], **config.trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_module())
    return timer.times[warmup:], timer.cpu_times[warmup:], _skipped(trainer)


# ---------------------------------------------------------------------------------- memory
def measure_memory(make_module: Callable[[], pl.LightningModule], config: Config, steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` steps; RSS on the next-to-last, tensors on the last (the first ones allocate state)."""
    pl.seed_everything(0, verbose=False)
    probe = MemoryProbe(rss_step=steps - 2, tensor_step=steps - 1)
    module = make_module()
    trainer = _trainer(steps, [probe], **config.trainer_kwargs())
    with warnings.catch_warnings(), open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return probe.result


class _Profile(pl.Callback):
    """Profile the training steps after ``warmup`` (CPU, self time per op)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.profiler: Any = None
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.profiler is not None:
            self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)


def profile_config(
    make_module: Callable[[], pl.LightningModule], config: Config, steps: int, warmup: int, top: int = 14
) -> str:
    """Top ops by self CPU time per step (all threads), as a Markdown table."""
    pl.seed_everything(0, verbose=False)
    prof = _Profile(warmup)
    trainer = _trainer(warmup + steps, [prof], **config.trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_module())
    averages = sorted(prof.profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in averages)
    lines = [
        f"### {config.name}: {total / 1e3 / prof.steps:.1f} ms self CPU per step (profiled)\n",
        "| op | self CPU ms/step | share | calls/step |",
        "|---|---:|---:|---:|",
    ]
    for e in averages[:top]:
        lines.append(
            f"| {e.key} | {e.self_cpu_time_total / 1e3 / prof.steps:.2f} "
            f"| {e.self_cpu_time_total / total:.1%} | {e.count / prof.steps:.0f} |"
        )
    return "\n".join(lines)


def measure_memory_subprocess(recipe: str, config: Config, threads: int, n_embd: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--memory-child", recipe, config.name, "--threads", str(threads)]
    if n_embd is not None:
        cmd += ["--n-embd", str(n_embd)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"memory run failed for {recipe} / {config.name}:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------- report
def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _activations(r: dict[str, Any]) -> str:
    if r.get("activations_mb") is None:
        return "-"
    return f"{r['activations_mb']:.2f} ({r.get('activations_fp32_mb', 0.0):.2f})"


def table(recipe: str, rows: dict[str, dict[str, Any]]) -> str:
    ref = rows[FP32_REFERENCE]
    lines = [
        "| config | ms/step (wall) | CPU ms/step | CPU vs 32-true | CPU vs Lightning counterpart | skipped "
        "| state MB | activations MB (FP32 part) | step peak MB | RSS step +MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        if config.name not in rows:
            continue
        r = rows[config.name]
        counterpart = rows[config.counterpart]["cpu_ms"] if config.counterpart in rows else None
        lines.append(
            f"| {config.name} | {r['wall_ms']:.2f} | {r['cpu_ms']:.2f} | {r['cpu_ms'] / ref['cpu_ms']:.2f}x "
            f"| {'-' if counterpart is None else format(r['cpu_ms'] / counterpart, '.2f') + 'x'} "
            f"| {'?' if r['skipped'] < 0 else r['skipped']} | {_fmt(r.get('state_mb'), '.2f')} "
            f"| {_activations(r)} | {_fmt(r.get('step_peak_mb'), '.2f')} "
            f"| {_fmt(r.get('rss_step_mb'))} |"
        )
    return "\n".join(lines)


def goals(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    out = []
    for recipe, r in rows.items():
        if "ours fp16" not in r:
            continue
        fp32 = r[FP32_REFERENCE]
        fp16 = r["ours fp16"]
        line = (
            f"- {recipe}: ours fp16 (emulated, FP32 masters) / Lightning 32-true per step: "
            f"{fp16['cpu_ms'] / fp32['cpu_ms']:.2f}x CPU, {fp16['wall_ms'] / fp32['wall_ms']:.2f}x wall "
            f"(goal <= 1.15x)"
        )
        if fp16.get("activations_mb") and fp32.get("activations_mb"):
            line += (
                f"; activations fp16 / 32-true: {fp16['activations_mb'] / fp32['activations_mb']:.2f}, "
                f"step peak: {fp16['step_peak_mb'] / fp32['step_peak_mb']:.2f}"
            )
        out.append(line)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per fit (emulated/FP32 configurations)")
    parser.add_argument("--native-steps", type=int, default=4, help="steps per fit (native half kernels)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every fit")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument(
        "--configs",
        nargs="+",
        default=[c.name for c in CONFIGS],
        choices=list(BY_NAME),
        metavar="CONFIG",
        help=f"a subset of the configurations (must include {FP32_REFERENCE!r})",
    )
    parser.add_argument("--n-embd", type=int, default=None, help="char_gpt width (default 128)")
    parser.add_argument("--memory", choices=("subprocess", "inprocess", "off"), default="subprocess")
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 round, in-process memory")
    parser.add_argument(
        "--profile",
        nargs="+",
        metavar="CONFIG",
        choices=list(BY_NAME),
        help="instead of the tables: the top ops by self CPU time of these configurations",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "end_to_end.json")
    parser.add_argument("--memory-child", nargs=2, metavar=("RECIPE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for logger in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.WARNING)  # no per-Trainer banners
    recipes = dict(QUICK_RECIPES if args.quick else RECIPES)
    if args.n_embd is not None:
        recipes["char_gpt"] = partial(recipes["char_gpt"], n_embd=args.n_embd)
    configs = [c for c in CONFIGS if c.name in args.configs]
    if FP32_REFERENCE not in args.configs and not args.profile:
        parser.error(f"--configs must include {FP32_REFERENCE!r} (the reference)")

    if args.memory_child:  # one fresh process per configuration
        recipe, name = args.memory_child
        print(json.dumps(measure_memory(recipes[recipe], BY_NAME[name])))
        return

    if args.quick:
        args.rounds, args.steps, args.native_steps, args.warmup = 1, 3, 3, 1
        if args.memory == "subprocess":
            args.memory = "inprocess"

    if args.profile:  # where the time goes, per op
        for recipe in args.recipes:
            print(f"\n## {recipe}, {torch.get_num_threads()} thread(s)\n")
            for name in args.profile:
                config = BY_NAME[name]
                steps = args.native_steps if config.native else args.steps
                print(profile_config(recipes[recipe], config, steps, args.warmup) + "\n")
        return

    results: dict[str, dict[str, dict[str, Any]]] = {}
    for recipe in args.recipes:
        make = recipes[recipe]
        wall: dict[str, list[float]] = {c.name: [] for c in configs}
        cpu: dict[str, list[float]] = {c.name: [] for c in configs}
        skipped: dict[str, int] = {c.name: 0 for c in configs}
        for round_ in range(args.rounds):
            for config in rotated(configs, round_):
                steps = args.native_steps if config.native else args.steps
                w, c, s = time_config(make, config, steps + args.warmup, args.warmup)
                wall[config.name] += w
                cpu[config.name] += c
                skipped[config.name] = s if s < 0 else max(skipped[config.name], s)
        rows = {
            name: {
                "wall_ms": statistics.median(wall[name]) * 1e3,
                "cpu_ms": statistics.median(cpu[name]) * 1e3,
                "timed_steps": len(wall[name]),
                "skipped": skipped[name],
            }
            for name in wall
        }
        for config in configs:
            if args.memory == "subprocess":
                rows[config.name].update(measure_memory_subprocess(recipe, config, args.threads, args.n_embd))
            elif args.memory == "inprocess":
                mem = measure_memory(make, config)
                mem.pop("rss_step_mb", None)  # other configurations ran in this process: not comparable
                rows[config.name].update(mem)
        results[recipe] = rows

    command = "python benchmarks/bench_end_to_end.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(
        f"# End to end per precision, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
        f"{args.rounds} round(s), {args.steps} steps/fit ({args.native_steps} for native half kernels), "
        f"median after {args.warmup} warm-up steps per fit"
    )
    print(f"command: {command.strip()}")
    for recipe, rows in results.items():
        print(f"\n## {recipe}\n")
        print(table(recipe, rows))
    print("\n## Goals\n")
    print(goals(results))
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": command.strip(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "rounds": args.rounds,
            "steps": args.steps,
            "native_steps": args.native_steps,
            "char_gpt_n_embd": args.n_embd or 128,
        }
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
