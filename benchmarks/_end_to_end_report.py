"""The Markdown ``bench_end_to_end.py`` prints: a table per recipe and the goal lines."""

from __future__ import annotations

from typing import Any

from _end_to_end_configs import CONFIGS, FP32_REFERENCE

__all__ = ["goals", "table"]


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
