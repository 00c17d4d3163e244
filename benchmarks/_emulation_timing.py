"""Timing for ``bench_emulation.py``: wall and process CPU time per call, variants alternating
round by round, medians, and the Markdown table with ratios against a base variant."""

from __future__ import annotations

import contextlib
import statistics
import time

__all__ = ["calibrate", "run_rounds", "table", "timed"]


def timed(fn, inner: int = 1, ctx=contextlib.nullcontext) -> tuple[float, float]:
    """(wall, cpu) seconds per call of ``fn`` averaged over ``inner`` calls made
    inside one ``ctx()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    with ctx():
        for _ in range(inner):
            fn()
    return (time.perf_counter() - w0) / inner, (time.process_time() - c0) / inner


def run_rounds(variants: dict, rounds: int, warmup: int = 1, only_first: dict | None = None) -> dict:
    """Alternate the variants round by round. ``variants``: name -> (fn, inner, ctx).
    ``only_first``: name -> number of rounds that variant takes part in (slow ones)."""
    only_first = only_first or {}
    samples: dict = {name: [] for name in variants}
    for name, (fn, _inner, ctx) in variants.items():
        for _ in range(0 if name in only_first else warmup):  # slow ones: their first round is long enough
            with ctx():
                fn()
    for r in range(rounds):
        for name, (fn, inner, ctx) in variants.items():
            if r < only_first.get(name, rounds):
                samples[name].append(timed(fn, inner, ctx))
    return {
        name: (statistics.median(s[0] for s in v) * 1e3, statistics.median(s[1] for s in v) * 1e3, len(v))
        for name, v in samples.items()
        if v  # a variant given 0 rounds (--skip-native-training) is left out
    }


def calibrate(fn, ctx, target_s: float = 0.05) -> int:
    timed(fn, 1, ctx)
    _, cpu = timed(fn, 1, ctx)
    return max(1, int(target_s / max(cpu, 1e-6)))


def table(results: dict, base: str, title: str) -> str:
    bw, bc, _ = results[base]
    lines = [
        f"### {title}",
        "",
        "| variant | wall ms | wall vs FP32 | CPU ms | CPU vs FP32 | rounds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (w, c, n) in results.items():
        lines.append(f"| {name} | {w:.2f} | {w / bw:.2f}x | {c:.2f} | {c / bc:.2f}x | {n} |")
    return "\n".join(lines)
