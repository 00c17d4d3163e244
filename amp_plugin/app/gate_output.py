"""What ``amp-gate`` prints (:func:`format_report`), and where its runs' output goes (:func:`output_to`).

A run prints its summary, Lightning prints its banners through ``logging``, warnings go to
``sys.stderr``, and compiled code (a first build of the fused kernels, oneDNN) writes to the file
descriptors directly. :func:`output_to` sends all four to one file while it is active: the file
descriptors 1 and 2, ``sys.stdout``/``sys.stderr`` (which pytest or a notebook may have replaced),
and every ``logging.StreamHandler`` but a ``FileHandler`` (Lightning's, which took the ``sys.stderr`` of
the moment it was made: under pytest that is not the process's).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import IO, Any

__all__ = ["cpu_model", "format_report", "output_to"]


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers: list[Any] = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    found: list[logging.StreamHandler] = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            is_console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if is_console and handler not in found:
                found.append(handler)
    return found


def _point(handler: logging.StreamHandler, stream: IO[str], away_from: IO[str] | None = None) -> None:
    """Point a console handler at ``stream``. Unlike ``setStream``, without flushing its old stream
    (a file this module closed since), and where a library bound the handler's ``flush`` to the
    stream it was made with (``transformers`` binds ``sys.stderr.flush``, which is the log while a
    block runs) and that stream is ``away_from``, that binding follows ``stream``."""
    handler.acquire()
    try:
        handler.stream = stream
        bound = handler.__dict__.get("flush")
        if away_from is not None and getattr(bound, "__self__", None) is away_from:
            handler.flush = stream.flush  # type: ignore[method-assign]
    finally:
        handler.release()


@contextmanager
def output_to(log: IO[str]) -> Iterator[None]:
    """Send everything written to standard output and standard error to ``log`` (an open text
    file with a file descriptor) until the block ends; then restore every stream as it was."""
    stderr = sys.stderr
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved: list[tuple[int, int]] = []
    for fd in (1, 2):
        try:
            saved.append((fd, os.dup(fd)))
        except OSError:  # no such descriptor (a GUI process): nothing to redirect there
            continue
        os.dup2(log.fileno(), fd)
    handlers = [(h, h.stream) for h in _stream_handlers()]
    for handler, _ in handlers:
        _point(handler, log)
    try:
        with redirect_stdout(log), redirect_stderr(log):
            yield
    finally:
        log.flush()
        for handler, stream in handlers:
            _point(handler, stream, away_from=log)
        for handler in _stream_handlers():  # made inside the block (an import): it took the log for stderr
            if handler.stream is log:
                _point(handler, stderr, away_from=log)
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4g}" if value < 0 else f"{value:.4g}"


def format_report(report: dict[str, Any]) -> str:
    """The table ``amp-gate`` prints (see the module docstring)."""
    a, b = report["candidate"], report["reference"]
    lines = [
        f"amp-gate: precision={a} against {b}, {len(report['seeds'])} paired seeds {report['seeds']}",
        f"  overrides  {' '.join(report['overrides']) or '(none)'}",
        f"  noise band max({report['sigmas']:g} SE, {100 * report['tolerance']:g}% of {b}'s mean)",
    ]
    if report.get("metrics"):
        head = ["metric", f"{a} mean", f"{b} mean", "A-B", "SE", "band", "verdict"]
        rows = [
            [
                m["metric"],
                _fmt(m["mean_a"]),
                _fmt(m["mean_b"]),
                "-" if m["diff"] is None else f"{m['diff']:+.4g}",
                _fmt(m["se"]),
                _fmt(m["band"]),
                m["text"],
            ]
            for m in report["metrics"]
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines.append("")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    for name in (a, b):
        side = report.get("sides", {}).get(name)
        if side is None:
            continue
        bpp = side["bytes_per_param"]
        parts = ", ".join(f"{k} {bpp[k]:.2f}" for k in ("weights", "grads", "master", "master_grads", "moments"))
        lines.append(f"  {name}: {bpp['total']:.2f} bytes/param ({parts}); skipped steps {side['skipped_steps']}")
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    lines.append(f"verdict: {report['verdict']} (exit {report['exit_status']})")
    return "\n".join(lines)
