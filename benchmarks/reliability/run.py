"""Reliability numbers for RELIABILITY.md: bad input tried through the CLI, faults injected into real runs.

    python benchmarks/reliability/run.py [--work DIR] [--write RELIABILITY.md] [--only PART ...] [--out FILE]

Everything runs ``train.py`` (or ``amp-compare``) as a user or a scheduler would: in a
subprocess, with signals, concurrent processes, a full disk and damaged files.

1. Bad input: each command line (or environment, or file) must exit non-zero with a clear
   message: no traceback, the key, variable or path named, at most a few lines, and no
   ``summary.json`` left as if the run had worked.
2. Faults: for each, whether anything was lost (a checkpoint, a logged step, a run's files) and,
   where the protocol resumes, whether the resumed run ends bit for bit where an uninterrupted
   run ends (weights, FP32 masters, optimizer state, loss scale, step) and its logs read the same.

Writes ``benchmarks/results/reliability.json`` (or ``--out``) and prints the Markdown table; with ``--write``,
replaces the table between the ``reliability-table`` markers of that file.

The cases live beside this script, in ``benchmarks/reliability/``: ``reliability_inputs`` (bad input),
``reliability_scaler_faults``, ``reliability_interrupts``, ``reliability_run_dirs`` and
``reliability_unchanged`` (faults), on ``reliability_harness`` (processes, comparisons, and the
callbacks a child run builds from ``_target_``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reliability_harness import ROOT, K
from reliability_inputs import bad_inputs
from reliability_interrupts import disk_full, early_sigterm, interrupt, sigkill
from reliability_run_dirs import concurrent, deleted, live_sweep, stale_build_lock
from reliability_scaler_faults import collapse, divergence, fault_in_run, stalled
from reliability_unchanged import (
    late_sigterm,
    leftover_rank,
    overwrite_bad_value,
    overwrite_foreign,
    short_all_skipped,
    sweep_overwrite,
    taken_job,
)

__all__ = ["FAULTS", "main", "table"]

MARK = "<!-- reliability-table -->"
RESULTS = ROOT / "benchmarks" / "results" / "reliability.json"

# The fault cases by the name ``--only`` takes, in the table's order.
FAULTS = {
    "overflow": lambda w: fault_in_run(w, "overflow", [f"+fault.inject_inf_at=[5,{K + 7}]"], 2),
    "nan_loss": lambda w: fault_in_run(w, "NaN loss", [f"+fault.nan_loss_at=[4,{K + 4}]"], 2),
    "nan_input": lambda w: fault_in_run(w, "NaN input", [f"+fault.nan_input_at=[6,{K + 9}]"], 2),
    "collapse": collapse,
    "divergence": divergence,
    "sigkill": sigkill,
    "sigterm": lambda w: interrupt(w, signal.SIGTERM),
    "sigint": lambda w: interrupt(w, signal.SIGINT),
    "disk_full": disk_full,
    "concurrent": concurrent,
    "stalled": stalled,
    "live_sweep": live_sweep,
    "deleted": deleted,
    "early_sigterm": early_sigterm,
    "stale_build_lock": stale_build_lock,
    "overwrite_bad_value": overwrite_bad_value,
    "overwrite_foreign": overwrite_foreign,
    "sweep_overwrite": sweep_overwrite,
    "taken_job": taken_job,
    "leftover_rank": leftover_rank,
    "short_all_skipped": short_all_skipped,
    "sighup": lambda w: interrupt(w, signal.SIGHUP),
    "late_sigterm": late_sigterm,
}


# ---------------------------------------------------------------------------------- report
def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "**no**")


def table(inputs: list[dict[str, Any]], faults: list[dict[str, Any]]) -> str:
    clear = sum(r["clear"] for r in inputs)
    lines = [
        f"**Bad input: {len(inputs)} tried, {clear} with a clear message** (non-zero exit, no traceback, the key, "
        "variable or file named, a few lines at most, no summary.json).",
        "",
    ]
    unclear = [r for r in inputs if not r["clear"]]
    for r in unclear:
        lines.append(f"- not clear: {r['input']} ({r['problem']})")
    if unclear:
        lines.append("")
    lines += ["| fault injected | anything lost? | resume exact? | what happened |", "|---|---|---|---|"]
    for f in faults:
        lost = "n/a" if f["lost"] is None else "**yes**" if f["lost"] else "no"
        lines.append(f"| {f['fault']} | {lost} | {_yes(f['resume_exact'])} | {f['how']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="scratch directory (default: a fresh temporary one, deleted afterwards)")
    parser.add_argument("--write", help="a Markdown file whose table between the reliability-table markers to replace")
    parser.add_argument(
        "--out",
        default=str(RESULTS),
        help="the JSON results; a partial --only run keeps the other parts' earlier results from this file "
        "(default: benchmarks/results/reliability.json)",
    )
    parser.add_argument("--only", nargs="*", choices=["inputs", *FAULTS], help="run only these parts")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="amp_reliability_"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["inputs", *FAULTS])
    started = time.perf_counter()
    inputs = bad_inputs(work / "inputs") if "inputs" in only else []
    faults = []
    for key, protocol in FAULTS.items():
        if key in only:
            folder = work / key
            folder.mkdir()
            faults.append(protocol(folder))
            print(f"{faults[-1]['fault']}: lost={faults[-1]['lost']} exact={faults[-1]['resume_exact']}", flush=True)
    out = Path(args.out)
    if args.only and out.is_file():  # a partial run: keep the earlier results of the parts not run
        earlier = json.loads(out.read_text())
        if "inputs" not in only:
            inputs = earlier.get("bad_inputs", [])
        names = {f["fault"] for f in faults}
        faults = [f for f in earlier.get("faults", []) if f["fault"] not in names] + faults
    text = table(inputs, faults)
    print(text)
    out.write_text(
        json.dumps(
            {"bad_inputs": inputs, "faults": faults, "wall_time_s": round(time.perf_counter() - started)}, indent=2
        )
        + "\n"
    )
    if args.write:
        path = Path(args.write)
        before, rest = path.read_text().split(MARK, 1)
        _, after = rest.split(MARK, 1)
        path.write_text(f"{before}{MARK}\n{text}\n{MARK}{after}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
