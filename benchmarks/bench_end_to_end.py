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
import json
import logging
import shlex
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _end_to_end_configs import BY_NAME, CONFIGS, FP32_REFERENCE, QUICK_RECIPES, RECIPES
from _end_to_end_measure import measure_memory, measure_memory_subprocess, profile_config, time_config
from _end_to_end_report import goals, table
from _harness import rotated

RESULTS = Path(__file__).resolve().parent / "results"


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
