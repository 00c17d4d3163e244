"""Bytes per parameter of the training state, and peak process memory, per precision.

    python benchmarks/bench_memory.py                         # 16M parameters, one process
    python benchmarks/bench_memory.py --devices 2             # FSDP2, ModelParallelStrategy, per rank
    python benchmarks/bench_memory.py --quick                 # tiny model (the smoke test)
    python benchmarks/bench_memory.py --params 64 --configs "ours fp16" "Lightning bf16-mixed" --out mem.json
    python benchmarks/bench_memory.py --fused-adamw --configs "ours bf16_split" "ours bf16_lean" "ours bf16_sr"

The model is a stack of blocks ``Linear(d, d) -> LayerNorm(d) -> GELU`` (``d = 1024``;
``--params`` millions of parameters set the depth), trained ``--steps`` AdamW steps on
random regression data (batch 64, MSE loss in FP32; ``--fused-adamw``: ``AdamW(fused=True)``) through
``Trainer(accelerator="cpu", max_steps=..., logger=False, enable_checkpointing=False)`` (of
``amp_plugin.lightning.pl``). Configurations:

- ours, every preset (``amp_plugin.settings.PRESETS``), built as ``MixedPrecisionPlugin(preset)``
  with the default scaler and emulation a user gets: among them ``bf16_split`` (the FP32 master
  kept as the BF16 weight plus a 16-bit remainder), ``bf16_lean`` (that, with BF16 Adam moments)
  and ``bf16_sr`` (no master: stochastic rounding of the BF16 weight, BF16 moments). A preset
  this build does not have is listed as ``absent``, with no numbers;
- Lightning's own ``32-true``, ``16-mixed`` (with an explicit ``torch.amp.GradScaler("cpu")``:
  on CPU Lightning silently swaps ``16-mixed`` for ``bf16-mixed`` otherwise), ``bf16-mixed``
  and ``bf16-true``.

With ``--devices 2`` every configuration runs on two CPU processes (gloo) under
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``: the model is built on
the meta device (``Trainer.init_module(empty_init=True)``), each block is an FSDP2 unit, and
each rank materializes only its shards. Ours is
``MixedPrecisionPlugin`` with ``amp_plugin.fsdp.fully_shard_mixed`` (norm
layers their own FP32 units); Lightning's own use plain ``fully_shard`` (``16-mixed`` is not
offered: ``ModelParallelStrategy`` rejects it).

Training state, counted from the tensors' untyped storages (each storage once, by its data
pointer; DTensors by their local shard; ``amp_plugin.app.state_bytes.tally``, the accounting
``amp-gate`` reports), divided by the model's (global) parameter count:

- ``weights``: the module's parameters and buffers (under FSDP2: this rank's shards);
- ``grads``: their ``.grad``;
- ``master``: optimizer parameters that are not module parameters (FP32 master copies), and
  whatever else ``MasterWeightOptimizer.master_tensors()`` names (``bf16_split``: the
  extensions);
- ``master grads``: the masters' ``.grad`` (``MasterWeightOptimizer`` frees them after each
  step);
- ``moments``: every tensor in the optimizer state (AdamW's two moments and its step counters).

``total`` is their sum right after the last optimizer step, gradients still present (what a
step holds at its end); ``between steps`` is the same after ``zero_grad(set_to_none=True)``,
which this script applies after that measurement (Lightning applies it in the next step,
after the forward and before the backward, so a forward still holds the previous gradients).
Under FSDP2, ``gathered`` is what the forward of the last
block holds on top of the shards (the unsharded half or FP32 parameters of the units in
flight), measured in that forward, before its norm layer.

Peak RSS: ``ru_maxrss`` of the fresh process that ran the configuration (one per
configuration, one per rank with ``--devices 2``), next to the resident set right after the
imports (before the model is built); ``peak - imports`` is what building and training added.
The children run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``;
``--glibc-default`` leaves it dynamic): every allocation from 128 KiB up is then mapped and
unmapped on its own, so the resident set follows the live tensors. With the dynamic
threshold, freed multi-megabyte tensors raise it and later ones of that size stay in glibc's
heap after they are freed; the peak then also counts memory glibc holds but torch does not
(on the 16M model with FSDP2, 160-190 MiB per rank more).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # the project, and this script's helpers (also when loaded by path)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch
from _harness import cpu_model, lightning_16_mixed_cpu, quiet_trainer, skipped_steps
from _memory import proc_status_mb
from _memory_stack import Stack, StateProbe, shape_for

from amp_plugin.app.state_bytes import COMPONENTS
from amp_plugin.lightning import pl

MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold, kept fixed (MALLOC_MMAP_THRESHOLD_)
OURS = (
    "fp32",
    "fp16",
    "bf16",
    "fp16_autocast",
    "bf16_autocast",
    "fp16_pure",
    "bf16_pure",
    "bf16_split",
    "bf16_lean",
    "bf16_sr",
)
SPLIT = "bf16_split"  # under FSDP2 it trains as bf16 (the sharded FP32 parameters are the masters)
LIGHTNING_1 = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
LIGHTNING_FSDP = ("32-true", "bf16-mixed", "bf16-true")


def config_names(devices: int) -> list[str]:
    lightning = LIGHTNING_1 if devices == 1 else LIGHTNING_FSDP
    ours = OURS if devices == 1 else [p for p in OURS if p != SPLIT]  # FSDP2's shards are the masters
    return [f"ours {p}" for p in ours] + [_lightning_name(p) for p in lightning]


def _lightning_name(precision: str) -> str:
    return "Lightning 16-mixed (CPU GradScaler)" if precision == "16-mixed" else f"Lightning {precision}"


def _plugin(name: str, devices: int) -> dict[str, Any]:
    kind, _, preset = name.partition(" ")
    if kind == "ours":
        from amp_plugin.lightning import MixedPrecisionPlugin

        return {"plugins": [MixedPrecisionPlugin(preset)]}
    if preset.startswith("16-mixed"):
        return lightning_16_mixed_cpu()
    return {"precision": preset}


def run_child(
    name: str, params_m: float, d: int, steps: int, devices: int, result_dir: str | None, fused_adamw: bool = False
) -> dict[str, Any]:
    """Train one configuration in this (fresh) process and return its numbers."""
    rss_imports = proc_status_mb("VmRSS")
    pl.seed_everything(0, verbose=False)
    d, depth = shape_for(params_m, d)
    fsdp = None if devices == 1 else ("ours" if name.startswith("ours") else "lightning")
    probe = StateProbe()
    kwargs = _plugin(name, devices)
    if devices > 1:
        ModelParallelStrategy = pl.strategies.ModelParallelStrategy

        kwargs["strategy"] = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    trainer = quiet_trainer(steps, [probe], devices=devices, **kwargs)
    # Under FSDP2 the model is built on the meta device and each rank materializes only its
    # shards (Lightning calls reset_parameters after fully_shard), as a model too big for one
    # device must be; one process builds it in full.
    with trainer.init_module(empty_init=devices > 1):
        module = Stack(d, depth, steps, fsdp=fsdp, fused_adamw=fused_adamw)
    n_params = sum(p.numel() for p in module.parameters())
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    result = {
        "config": name,
        "rank": trainer.global_rank,
        "params": n_params,
        "d": d,
        "depth": depth,
        "during": probe.during,
        "between": probe.between,
        "gathered": probe.gathered,
        "skipped": skipped_steps(trainer),
        "optimizer": type(trainer.optimizers[0]).__name__,
        "rss_imports_mib": rss_imports,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "fit_s": time.perf_counter() - start,
    }
    if result_dir is not None:
        Path(result_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return result


def absent(name: str) -> str | None:
    """Why this build cannot run the configuration (a preset it does not have), or None."""
    kind, _, preset = name.partition(" ")
    if kind != "ours":
        return None
    from amp_plugin.settings import PRESETS

    return (
        None if preset in PRESETS else f"absent: {preset} is not a preset of this build (amp_plugin.settings.PRESETS)"
    )


def run_config(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One fresh process per configuration (it launches the second rank itself); a configuration
    this build does not have is one row saying so (:func:`absent`)."""
    reason = absent(name)
    if reason is not None:
        return [{"config": name, "rank": rank, "absent": reason} for rank in range(args.devices)]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--params",
            str(args.params),
            "--d",
            str(args.d),
            "--steps",
            str(args.steps),
            "--devices",
            str(args.devices),
            "--result-dir",
            tmp,
        ]
        if args.fused_adamw:
            cmd.append("--fused-adamw")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if not args.glibc_default:
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=ROOT)
        deadline = time.time() + 60
        files = [Path(tmp, f"rank{r}.json") for r in range(args.devices)]
        while out.returncode == 0 and not all(f.exists() for f in files) and time.time() < deadline:
            time.sleep(0.5)  # the other rank may still be writing
        if out.returncode != 0 or not all(f.exists() for f in files):
            raise RuntimeError(f"{name} failed (exit {out.returncode}):\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


# ---------------------------------------------------------------------------------- report
def per_param(row: dict[str, Any], key: str) -> dict[str, float]:
    return {k: v / row["params"] for k, v in row[key].items()}


def table(rows: list[dict[str, Any]], devices: int) -> str:
    head = (
        "| config | weights | grads | master | master grads | moments | total (B/param) | between steps "
        + ("| gathered in fwd " if devices > 1 else "")
        + "| peak RSS MiB | peak - imports MiB | skipped | optimizer |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        label = row["config"] + (f" (rank {row['rank']})" if devices > 1 else "")
        if "absent" in row:
            lines.append(f"| {label} | {row['absent']} |")
            continue
        during, between = per_param(row, "during"), per_param(row, "between")
        cells = [
            label,
            *(f"{during[c]:.2f}" for c in COMPONENTS),
            f"**{sum(during.values()):.2f}**",
            f"{sum(between.values()):.2f}",
        ]
        if devices > 1:
            cells.append(f"{row['gathered'] / row['params']:.2f}")
        skipped = "-" if row["skipped"] is None else str(row["skipped"])
        cells += [
            f"{row['peak_rss_mib']:.0f}",
            f"{row['peak_rss_mib'] - row['rss_imports_mib']:.0f}",
            skipped,
            row["optimizer"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=16.0, help="millions of parameters (default 16)")
    parser.add_argument("--d", type=int, default=1024, help="block width (default 1024)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: FSDP2 under ModelParallelStrategy on two CPU processes, numbers per rank",
    )
    parser.add_argument("--threads", type=int, default=None, help="OMP threads per process (default: cores / devices)")
    parser.add_argument("--configs", nargs="+", metavar="CONFIG", help="a subset of the configurations")
    parser.add_argument("--quick", action="store_true", help="tiny model (width 64, 0.05M parameters), 2 steps")
    parser.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) instead of the default AdamW")
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help=f"keep glibc's dynamic mmap threshold (default: fixed at {MMAP_THRESHOLD} bytes)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        run_child(args.child, args.params, args.d, args.steps, args.devices, args.result_dir, args.fused_adamw)
        return
    if args.quick:
        args.params, args.d, args.steps = 0.05, 64, 2
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.devices)
    names = config_names(args.devices)
    if args.configs:
        unknown = [c for c in args.configs if c not in names]
        if unknown:
            parser.error(f"unknown configs {unknown}; choose from {names}")
        names = [n for n in names if n in args.configs]

    command = "python benchmarks/bench_memory.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    d, depth = shape_for(args.params, args.d)
    print(f"# Training state per parameter, {depth} x (Linear({d}, {d}) + LayerNorm + GELU), {args.steps} AdamW steps")
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}; {pl.__name__} {pl.__version__}; "
        f"{args.threads} thread(s) per process; devices={args.devices}; "
        f"MALLOC_MMAP_THRESHOLD_={'glibc default (dynamic)' if args.glibc_default else MMAP_THRESHOLD}"
        + (" (FSDP2, ModelParallelStrategy, gloo; bytes per rank / global parameters)" if args.devices > 1 else "")
    )
    print(f"command: {command.strip()}")
    print(
        "total: right after the last optimizer step, gradients present; between steps: the same "
        "after zero_grad(set_to_none=True) (applied by this script after the first count)\n"
    )
    rows: list[dict[str, Any]] = []
    for name in names:
        rows += run_config(name, args)
    measured = [row for row in rows if "absent" not in row]
    print(f"parameters: {measured[0]['params']:,}\n" if measured else "parameters: - (no configuration measured)\n")
    print(table(rows, args.devices))
    if args.out:
        meta = {
            "command": command.strip(),
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "malloc_mmap_threshold": None if args.glibc_default else MMAP_THRESHOLD,
            "lightning": f"{pl.__name__} {pl.__version__}",
            "threads": args.threads,
            "devices": args.devices,
            "steps": args.steps,
            "params": measured[0]["params"] if measured else None,
            "d": d,
            "depth": depth,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
