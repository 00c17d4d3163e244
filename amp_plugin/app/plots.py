"""Per-run and cross-run plots: loss, loss scale (log axis) and skipped steps against step.

How to read them:

- **loss**: the training loss per step (thin line) and the validation loss where validation
  ran (dots). A flat line while FP32 falls is underflow or stagnation.
- **loss scale**: the scale the loss is multiplied by before backward, on a log axis. Each
  drop is an overflow (a step with an inf/NaN gradient, skipped); each rise is a growth after
  ``growth_interval`` clean steps. A staircase down to ``min_scale`` means the gradients
  overflow at any scale (NaNs in the data or the loss, a diverging LR). No line: no scaler.
- **skipped steps**: the running count of skipped optimizer steps. A few early ones are
  normal (the scale searching downward from 2**16); a steadily rising count is not.

Uses matplotlib's Agg canvas directly, so no display and no global backend switch.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["plot_compare", "plot_run", "read_history", "write_history"]

_FIRST_COLUMNS = ("step", "train_loss", "loss_scale", "skipped_steps", "lr")


def write_history(rows: Sequence[Mapping[str, float]], path: str | Path) -> Path:
    """Write per-step rows as CSV (``step, train_loss, loss_scale, skipped_steps, lr, val/...``)."""
    extra = sorted({k for row in rows for k in row} - set(_FIRST_COLUMNS))
    columns = list(_FIRST_COLUMNS) + extra
    path = Path(path)
    temp = path.with_name(f".{path.name}.tmp")
    with temp.open("w", newline="") as f:  # then renamed into place: a reader never sees half a file
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if _missing(row.get(c)) else _cell(c, row[c]) for c in columns])
    os.replace(temp, path)
    return path


def read_history(path: str | Path) -> list[dict[str, float]]:
    """Read :func:`write_history`'s CSV back (empty cells become NaN).

    Raises:
        ValueError: the file is not such a CSV (a cell that is not a number, no ``step`` column);
            the message names the file and the line.
    """
    rows = []
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{path}: not a training-curves CSV (no 'step' column in its header)")
        for row in reader:
            try:
                rows.append({k: float(v) if v not in ("", None) else math.nan for k, v in row.items() if k is not None})
            except ValueError as err:
                raise ValueError(f"{path}, line {reader.line_num}: {err}") from None
    return rows


def _missing(value: float | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(column: str, value: float) -> str:
    if column in ("step", "skipped_steps"):
        return str(int(value))
    return repr(float(value))


def _column(rows: Sequence[Mapping[str, float]], key: str) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        value = row.get(key)
        if not _missing(value):
            xs.append(row["step"])
            ys.append(cast(float, value))  # not None: _missing checked
    return xs, ys


def _axes(title: str | None) -> tuple[Figure, list]:
    fig = Figure(figsize=(8, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=[2, 1, 1])
    if title:
        fig.suptitle(title)
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel("loss scale")
    axes[2].set_ylabel("skipped steps\n(cumulative)")
    axes[2].set_xlabel("step")
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _log_if_wide(ax, values: Sequence[float]) -> None:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > 50:
        ax.set_yscale("log")


def _draw(axes: list, rows: Sequence[Mapping[str, float]], label: str | None, color: str | None) -> None:
    xs, loss = _column(rows, "train_loss")
    line = axes[0].plot(xs, loss, lw=0.8, alpha=0.8, label=(f"{label} train" if label else "train"), color=color)[0]
    color = line.get_color()
    vx, vloss = _column(rows, "val/loss")
    if vx:
        axes[0].plot(vx, vloss, "o-", ms=3, lw=1.2, color=color, label=(f"{label} val" if label else "val"))
    sx, scale = _column(rows, "loss_scale")
    if sx:
        axes[1].step(sx, scale, where="post", color=color, label=label)
        axes[1].set_yscale("log", base=2)
    kx, skipped = _column(rows, "skipped_steps")
    axes[2].step(kx, skipped, where="post", color=color, label=label)
    top = max([1.0, *(max(line.get_ydata(), default=0.0) for line in axes[2].lines)])
    axes[2].set_ylim(-0.05 * top, 1.05 * top)  # counts start at 0; a flat 0 sits at the bottom


def plot_run(rows: Sequence[Mapping[str, float]], path: str | Path, title: str | None = None) -> Path:
    """Plot one run's history (rows from :class:`~amp_plugin.app.report.RunRecorder`) to a PNG."""
    fig, axes = _axes(title)
    _draw(axes, rows, None, None)
    _log_if_wide(axes[0], _column(rows, "train_loss")[1] + _column(rows, "val/loss")[1])
    if not _column(rows, "loss_scale")[0]:
        axes[1].text(
            0.5,
            0.5,
            "no loss scaling (scaler=none)",
            ha="center",
            va="center",
            transform=axes[1].transAxes,
            color="grey",
        )
    axes[0].legend(loc="upper right")
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def plot_compare(
    runs: Sequence[tuple[str, Sequence[Mapping[str, float]]]], path: str | Path, title: str | None = None
) -> Path:
    """Plot several runs (``(label, rows)`` pairs) on shared axes to a PNG."""
    fig, axes = _axes(title)
    values: list[float] = []
    for label, rows in runs:
        _draw(axes, rows, label, None)
        values += _column(rows, "train_loss")[1] + _column(rows, "val/loss")[1]
    _log_if_wide(axes[0], values)
    axes[0].legend(loc="upper right", fontsize="small", ncol=2)
    if any(_column(rows, "loss_scale")[0] for _, rows in runs):
        axes[1].legend(loc="lower right", fontsize="small")
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
