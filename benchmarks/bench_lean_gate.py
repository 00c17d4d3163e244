"""The lean presets against ``bf16`` through ``amp-gate``, on regimes long enough for Adam's second moment.

    python benchmarks/bench_lean_gate.py [--regimes digits char_gpt vit bert bert_grad_drop]
        [--candidates bf16_lean bf16_sr bf16_lean:nearest] [--seeds 4] [--dir lean_gate]
        [--json benchmarks/results/lean_gate.json] [--steps-scale 1.0]

For every regime and candidate it runs ``amp-gate precision=CANDIDATE --against bf16`` with the
regime's overrides (paired seeds: both sides start from the same weights and see the same batches)
into one directory per regime, so the ``bf16`` runs train once and every candidate reuses them. A
candidate ``PRESET:nearest`` is the preset with ``precision.moments_rounding=nearest``: its BF16
moments rounded to nearest, what ``bf16_lean``/``bf16_sr`` stored before moments were rounded
stochastically (the "before" row).

The regimes use the recipes' own hyperparameters. ``vit`` and ``bert`` train AdamW at torch's
default betas (0.9, 0.999) for 1500 steps, past the second moment's 1000-step time constant;
``digits`` AdamW at the same betas for 1500 steps; ``char_gpt`` (beta2 = 0.95) its default 600
steps; ``bert_grad_drop`` is the gate regime of docs/quality_gate.md (every gradient 10x smaller
from step 100, 400 steps, a 0.1% tolerance). ``--steps-scale`` multiplies every step count (a
quick look, or the smoke test).

Prints one Markdown row per regime and candidate (bytes per parameter, the mean validation loss of
both sides, the paired difference with its standard error and relative size, the accuracy's
difference, the verdict) and writes every gate report to ``--json``. No timing: the numbers depend
on the torch build and the CPU's BF16 arithmetic (emulated or native), not on the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from amp_plugin.app.gate import main as gate_main

REGIMES: dict[str, tuple[int, list[str]]] = {
    "digits": (1500, ["recipe=digits"]),
    "char_gpt": (600, ["recipe=char_gpt", "trainer.limit_val_batches=20"]),
    "vit": (1500, ["recipe=vit"]),
    "bert": (1500, ["recipe=bert"]),
    "bert_grad_drop": (400, ["recipe=bert_grad_drop", "--tolerance", "0.001"]),
}
"""name -> (optimizer steps, overrides and gate options)."""


def candidate_args(candidate: str) -> list[str]:
    preset, _, rounding = candidate.partition(":")
    return [f"precision={preset}"] + ([f"precision.moments_rounding={rounding}"] if rounding else [])


def gate(regime: str, candidate: str, args: argparse.Namespace) -> dict[str, Any]:
    steps, extra = REGIMES[regime]
    steps = max(2, round(steps * args.steps_scale))
    report_path = args.dir / regime / f"{candidate.replace(':', '-')}.json"
    argv = [
        *candidate_args(candidate),
        f"trainer.max_steps={steps}",
        *extra,
        "--against",
        "bf16",
        "--seeds",
        str(args.seeds),
        "--dir",
        str(args.dir / regime),
        "--json",
        str(report_path),
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = gate_main(argv)
    if status not in (0, 1):
        sys.stdout.write(out.getvalue())
        raise SystemExit(f"amp-gate {' '.join(argv)} exited {status}")
    report = json.loads(report_path.read_text())
    report["regime"] = regime
    report["label"] = candidate
    report["steps"] = steps
    return report


def row(report: dict[str, Any]) -> str:
    metrics = {m["metric"]: m for m in report["metrics"]}
    loss = metrics["val/loss"]
    sides = report["sides"]
    cand, ref = report["candidate"], report["reference"]
    label = report["label"].replace(":", " (moments rounded to ") + (")" if ":" in report["label"] else "")
    acc = metrics.get("val/acc")
    acc_cell = f"{acc['diff']:+.4f} ± {acc['se']:.4f}" if acc else "-"
    return (
        f"| `{report['regime']}`, {report['steps']} steps | `{label}` "
        f"| {sides[cand]['bytes_per_param']['total']:.2f} ({sides[ref]['bytes_per_param']['total']:.2f}) "
        f"| {loss['mean_a']:.4f}, {loss['mean_b']:.4f} "
        f"| {loss['diff']:+.4f} ± {loss['se']:.4f} ({100 * loss['relative']:+.2f}%, "
        f"{abs(loss['diff']) / loss['se'] if loss['se'] else float('inf'):.1f} SE) "
        f"| {acc_cell} | **{report['verdict']}** |"
    )


HEADER = (
    "| regime | candidate | bytes/param (`bf16`) | val/loss: candidate, `bf16` | difference ± SE (relative, SEs) "
    "| val/acc difference ± SE | verdict |\n|---|---|---:|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--candidates", nargs="+", default=["bf16_lean", "bf16_sr", "bf16_lean:nearest"])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=Path("lean_gate"))
    parser.add_argument("--json", type=Path, help="all gate reports, as one JSON list")
    parser.add_argument("--steps-scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    for candidate in args.candidates:
        rounding = candidate.partition(":")[2]
        if rounding not in ("", "nearest", "stochastic"):
            parser.error(f"--candidates {candidate}: the rounding after ':' is nearest or stochastic")
    print(HEADER, flush=True)
    reports = []
    for regime in args.regimes:
        for candidate in args.candidates:
            reports.append(gate(regime, candidate, args))
            print(row(reports[-1]), flush=True)
    cpu = reports[0]["cpu"] if reports else platform.machine()
    print(
        f"\n{cpu} (torch CPU capability {torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{args.seeds} paired seeds from seed 0"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
