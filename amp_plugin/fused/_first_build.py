"""The first build of the fused kernels: said once on stderr, timed apart, never waited on forever.

- :func:`build_lock`: an ``flock`` on ``<entry>/amp_plugin-build.lock`` around torch's build. The
  operating system drops it when its holder dies, however it dies, so holding it proves that no
  live process of this project is building the entry: torch's own lock file (``<entry>/lock``,
  created with ``O_EXCL`` and waited on with no time limit) is then stale, left by a build that was
  killed half-way, and is deleted with a note on stderr naming it. A live builder is waited for
  at most ``timeout`` seconds (:data:`TIMEOUT_ENV`, default 1200), with a note naming the file
  and the process; after that the run goes on with the stock ops. :func:`lock_timeout` reads the
  variable and refuses a value that is not a finite number of seconds above 0 (``nan``, ``inf``,
  ``0`` and ``-1`` would wait forever or not at all).
- :func:`announce`: what is being built, where, and roughly how long it takes, once per process.
- :func:`progress`: while the compiler runs, the time elapsed on stderr: one line rewritten every
  second on a terminal, a plain line every 10 s otherwise (a log file), then the total.
- :func:`seconds_spent`: the time this process spent building or waiting for a build, which the
  app leaves out of a run's wall time and steps/s.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "BuildLockTimeout",
    "announce",
    "build_lock",
    "lock_timeout",
    "progress",
    "seconds_spent",
    "timed",
]

TIMEOUT_ENV = "AMP_PLUGIN_FUSED_BUILD_TIMEOUT"
LOCK_NAME = "amp-plugin-build.lock"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
DEFAULT_TIMEOUT = 1200.0
_spent = [0.0]
_announced: set[str] = set()


class BuildLockTimeout(TimeoutError):
    """Another live process held the build lock for longer than the timeout."""


def seconds_spent() -> float:
    """Seconds this process has spent in :func:`timed` blocks (building, loading, waiting)."""
    return _spent[0]


@contextlib.contextmanager
def timed() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _spent[0] += time.perf_counter() - start


def announce(name: str, build_directory: str, variant: str) -> None:
    """Say on stderr, once per process and entry, that the kernels are compiled now and for about how long."""
    if name in _announced:
        return
    _announced.add(name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rough = "1 to 3 minutes" if cores <= 4 else "under a minute"
    print(
        f"amp_plugin: building the fused C++ CPU kernels ({variant}) for this environment, once; this takes "
        f"{rough} with {cores} cores. They are cached in {build_directory}; the time is not counted in the "
        f"run's steps/s. Set AMP_PLUGIN_FUSED=0 to use stock torch ops instead.",
        file=sys.stderr,
        flush=True,
    )


def lock_timeout() -> float:
    """Seconds to wait for another live process's build: :data:`TIMEOUT_ENV`, or
    :data:`DEFAULT_TIMEOUT` when it is unset or empty.

    Raises:
        ValueError: the variable holds something other than a finite number of seconds above 0.
    """
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"{TIMEOUT_ENV}={value!r} is not allowed: it is the seconds to wait for another process's build of "
            f"the fused kernels, a finite number > 0 (default {DEFAULT_TIMEOUT:g} when unset); set it to, say, "
            f"{TIMEOUT_ENV}=3600, or unset it"
        )
    return seconds


@contextlib.contextmanager
def progress(
    what: str, stream: TextIO | None = None, every: float | None = None, clock=time.monotonic
) -> Iterator[None]:
    """Say on ``stream`` (default stderr) how long ``what`` has taken while the block runs.

    On a terminal one line is rewritten (``\\r``) every second; elsewhere (a log file, a pipe) a plain
    line is written every 10 s, so the log holds a few lines, not one per second. When the block
    ends the line says the total: ``amp_plugin: <what>: done in 84 s`` (or ``stopped after``).
    ``every`` overrides the interval.
    """
    out = sys.stderr if stream is None else stream
    tty = bool(getattr(out, "isatty", lambda: False)())
    interval = every if every is not None else (1.0 if tty else 10.0)
    start, stop = clock(), threading.Event()

    def say(text: str, end: str) -> None:
        with contextlib.suppress(ValueError, OSError):  # the stream was closed under us
            out.write(("\r" if tty else "") + text + end)
            out.flush()

    def tick() -> None:
        while not stop.wait(interval):
            say(f"amp_plugin: {what}: {clock() - start:.0f} s", "" if tty else "\n")

    ticker = threading.Thread(target=tick, name="amp_plugin-build-progress", daemon=True)
    ticker.start()
    done = False
    try:
        yield
        done = True
    finally:
        stop.set()
        ticker.join()
        elapsed = clock() - start
        say(f"amp_plugin: {what}: {'done in' if done else 'stopped after'} {elapsed:.0f} s", "\n")


@contextlib.contextmanager
def build_lock(build_directory: str, timeout: float | None = None, poll: float = 0.2) -> Iterator[None]:
    """Hold the entry's build lock (see the module docstring) while torch builds or loads it.

    Raises:
        BuildLockTimeout: another live process held it for more than ``timeout`` seconds (default:
            :func:`lock_timeout`).
        ValueError: ``timeout`` (or :data:`TIMEOUT_ENV`) is not a finite number of seconds above 0.
    """
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock only
        yield
        return
    limit = lock_timeout() if timeout is None else timeout
    if not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"timeout={limit!r}: the seconds to wait for the build lock must be a finite number > 0")
    os.makedirs(build_directory, exist_ok=True)
    path = os.path.join(build_directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, said = time.monotonic() + limit, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(
                        f"waited {limit:g} s for the build lock {path}, held by {holder} (a build still running); "
                        f"set {TIMEOUT_ENV}=SECONDS to wait longer"
                    ) from None
                if not said:
                    said = True
                    print(
                        f"amp_plugin: waiting for {holder} to finish building the fused kernels (lock {path}; "
                        f"at most {limit:g} s, {TIMEOUT_ENV})",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        stale = os.path.join(build_directory, TORCH_LOCK)
        if os.path.exists(stale):  # no live builder of ours holds the entry: a killed build left it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
            print(
                f"amp_plugin: removed {stale}, a build lock left behind by a build that was killed (no live "
                "process holds the build); building again.",
                file=sys.stderr,
                flush=True,
            )
        yield
    finally:
        os.close(fd)  # drops the flock
