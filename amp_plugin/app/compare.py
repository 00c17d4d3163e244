"""Compare runs: ``amp-compare multirun/2025-01-01/12-00-00``.

Finds every run directory below the given paths (a directory holding ``summary.json``, or a
``FAILED`` note, which wins over a ``summary.json`` beside it: a run that finishes removes its
directory's ``FAILED``, so the note is the last attempt's, a resume in place that failed after an
earlier attempt wrote its summary), prints one table row per run (the overrides that distinguish it,
precision, scaler, final loss and metric, skipped steps, loss-scale end value, wall time)
and writes ``compare.csv`` and ``compare.png`` (all runs' loss, loss scale and skipped
steps on shared axes) into the first directory given, or ``--out``.

A damaged file never stops the comparison with a traceback: an unreadable ``summary.json``
lists its run as UNREADABLE, an unreadable ``training_curves.csv`` leaves that run out of the
plot, each with a warning naming the file, and the exit status is then 1. A file given as
``--out`` is refused (exit status 2).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amp_plugin.app import plots

__all__ = ["collect_runs", "format_table", "main"]

_METRICS = ("train/loss", "val/loss", "val/acc")


def _run_dirs(root: Path) -> list[Path]:
    if (root / "summary.json").is_file() or (root / "FAILED").is_file():
        return [root]
    found = {p.parent for name in ("summary.json", "FAILED") for p in root.rglob(name)}
    return sorted(found, key=_sort_key)


def _sort_key(path: Path) -> tuple:
    # Hydra names multirun jobs 0, 1, ..., 10: sort numerically where the name is a number.
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts)


def _overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides Hydra saved for the run, without ``hydra.*`` ones."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return [str(o) for o in OmegaConf.load(path) if not str(o).startswith("hydra.")]
    except Exception as err:  # a damaged file: label the run by its directory name instead
        _warn(
            f"{path}: cannot read the overrides ({' '.join(str(err).split())[:200]}); labelling the run by its "
            "directory name."
        )
        return None


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Short run labels: the overrides that tell the runs apart (a sweep's parameters)."""
    overrides = [_overrides(d) for d in run_dirs]
    known = [o for o in overrides if o is not None]
    common = set.intersection(*(set(o) for o in known)) if len(known) > 1 else set()
    labels = []
    for run_dir, items in zip(run_dirs, overrides):
        distinct = [o for o in items or [] if o not in common]
        labels.append(" ".join(distinct) if distinct else run_dir.name)
    return labels


def collect_runs(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """One dict per run found below ``paths``: the run's ``summary.json`` plus ``label``,
    ``dir`` and ``history`` (per-step rows), or ``status="failed"`` and ``error``."""
    run_dirs: list[Path] = []
    for root in map(Path, paths):
        if not root.exists():
            raise FileNotFoundError(f"{root}: no such directory")
        run_dirs += _run_dirs(root)
    runs = []
    for run_dir, label in zip(run_dirs, _labels(run_dirs)):
        summary_file, failed_file = run_dir / "summary.json", run_dir / "FAILED"
        run: dict[str, Any]
        if failed_file.is_file():  # the last attempt failed, whatever summary an earlier one left
            error = failed_file.read_text(errors="replace").strip()
            run = {"status": "failed", "error": error, "history": []}
        else:
            run = _read_summary(summary_file)
            history_file = run_dir / "training_curves.csv"
            run["history"] = _read_curves(history_file) if history_file.is_file() else []
        run["dir"] = str(run_dir)
        run["label"] = label
        runs.append(run)
    return runs


_skipped: list[str] = []  # what could not be read, for main's exit status


def _warn(message: str) -> None:
    _skipped.append(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _read_summary(path: Path) -> dict[str, Any]:
    """A run's summary; an unreadable one (truncated, not JSON, missing fields) becomes a failed row."""
    try:
        run = json.loads(path.read_text(errors="replace"))
        if not isinstance(run, dict):
            raise ValueError("not a JSON object")
        if run.get("status") == "ok":
            missing = [
                k
                for k in ("precision", "scaler", "recipe", "steps", "skipped_steps", "loss_scale", "wall_time_s")
                if k not in run
            ]
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
        return run
    except (ValueError, OSError) as err:
        reason = " ".join(str(err).split())
        _warn(f"{path}: cannot read the summary ({reason}); the run is listed as unreadable.")
        return {"status": "unreadable", "error": f"{path}: unreadable summary.json ({reason})"}


def _read_curves(path: Path) -> list[dict[str, float]]:
    """A run's training curves; an unreadable file is skipped (the run stays in the table)."""
    try:
        return plots.read_history(path)
    except (ValueError, OSError, UnicodeDecodeError) as err:
        _warn(f"{' '.join(str(err).split())}; its curves are left out of the plot.")
        return []


def _num(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e3:
        return str(int(value))
    if isinstance(value, float) and (abs(value) >= 1e5 or 0 < abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    metrics = [m for m in _METRICS if any(m in r.get("final_metrics", {}) for r in runs)]
    header = [
        "run",
        "precision",
        "scaler",
        "recipe",
        "steps",
        *metrics,
        "skipped",
        "retried",
        "wasted",
        "scale end",
        "time s",
    ]
    table = []
    for run in runs:
        if run.get("status") != "ok":
            table.append(
                [run["label"], "FAILED" if run.get("status") == "failed" else "UNREADABLE"] + ["-"] * (len(header) - 2)
            )
            continue
        final = run.get("final_metrics", {})
        table.append(
            [
                run["label"],
                run["precision"],
                run["scaler"],
                run["recipe"],
                str(run["steps"]),
                *(_num(final.get(m)) for m in metrics),
                str(run["skipped_steps"]),
                str(run.get("retried_steps", 0)),  # summaries written before retries existed: none
                f"{run['wasted_compute']:.1%}" if run.get("wasted_compute") is not None else "-",
                _num(run["loss_scale"]["end"]) if run["loss_scale"]["end"] is not None else "-",
                f"{run['wall_time_s']:.1f}",
            ]
        )
    return header, table


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table, one row per run."""
    header, table = _rows(runs)
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *table]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for run in runs:
        if run.get("status") != "ok":
            kind = "FAILED" if run.get("status") == "failed" else "UNREADABLE"
            lines.append(f"{kind} {run['label']}: {' '.join(str(run.get('error', '')).split())[:300]}")
    return "\n".join(lines)


def write_csv(runs: Sequence[dict[str, Any]], path: str | Path) -> Path:
    header, table = _rows(runs)
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*header, "dir"])
        for row, run in zip(table, runs):
            writer.writerow([*row, run["dir"]])
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="amp-compare",
        description="Compare amp_plugin training runs (for example the jobs of one Hydra multirun).",
    )
    parser.add_argument("dirs", nargs="+", help="run or multirun directories (searched recursively)")
    parser.add_argument("--out", help="directory for compare.csv and compare.png (default: the first dir)")
    parser.add_argument("--no-plot", action="store_true", help="only print the table and write compare.csv")
    args = parser.parse_args(argv)
    _skipped.clear()
    try:
        runs = collect_runs(args.dirs)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not runs:
        print(f"error: no runs (directories with summary.json) found under {' '.join(args.dirs)}", file=sys.stderr)
        return 1
    out = Path(args.out or args.dirs[0])
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file; give a directory for compare.csv and compare.png", file=sys.stderr)
        return 2
    print(format_table(runs))
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = [write_csv(runs, out / "compare.csv")]
        ok = [(run["label"], run["history"]) for run in runs if run.get("status") == "ok" and run["history"]]
        if ok and not args.no_plot:
            written.append(plots.plot_compare(ok, out / "compare.png", title=f"{len(ok)} runs"))
    except OSError as err:
        print(f"error: cannot write into {out}: {err.strerror or err}", file=sys.stderr)
        return 2
    print("\nwrote " + ", ".join(str(p) for p in written))
    # 1 when a run failed or a file could not be read: the table or the plot is not the whole story.
    return 0 if all(run.get("status") == "ok" for run in runs) and not _skipped else 1


if __name__ == "__main__":
    sys.exit(main())
