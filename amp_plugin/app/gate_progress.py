"""How far an ``amp-gate`` got, and the signals it holds while it records a finished run.

:class:`Progress` prints the gate's seed lines and, when a signal stops the gate, ends the open line
and says in one line what stopped where, which runs are kept and what the same command does next
(:func:`amp_plugin.app.gate.main`). :func:`signals_held` keeps a signal from landing between a run's
``summary.json`` and its ``gate_run.json``, which would make the next gate train a finished run again.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Progress", "signals_held"]

_HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGTERM, SIGINT and SIGHUP until the block ends, then act on the first that came (its handler
    as it was before). A signal between a run's ``summary.json`` and its ``gate_run.json`` would leave a
    finished run that the next gate cannot reuse and trains again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {signum: signal.signal(signum, lambda got, frame: received.append(got)) for signum in _HELD}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if received:
            signal.raise_signal(received[0])


@dataclass
class Progress:
    """How far the gate got, for its seed lines on the console and for the message of a gate that a
    signal stopped (:meth:`interrupted`): what the next gate will reuse is read from ``--dir`` then."""

    directory: Path
    total: int
    fresh: bool
    finished: Callable[[Path, Any], bool]  # whether a run's directory holds a run the next gate reuses
    plan: list[tuple[str, int, Path, Any]] = field(default_factory=list)  # preset, seed, directory, config
    current: tuple[str, int] | None = None  # the run under way (preset, seed)
    line_open: bool = False  # the console's seed line waits for its end

    def begin(self, preset: str, seed: int, first: bool) -> None:
        """A run starts: open its seed's line (``  seed 0:``), or go on with it (``,``)."""
        self.current = (preset, seed)
        print(f"  seed {seed}:" if first else ",", end="", flush=True)
        self.line_open = True

    def end(self, text: str, last: bool) -> None:
        """The run ended (``bf16 8.3 s``, ``bf16 failed``); ``last`` ends its seed's line."""
        print(f" {text}" if text else "", end="\n" if last else "", flush=True)
        self.current, self.line_open = None, not last

    def interrupted(self, signum: int, err: BaseException) -> str:
        """End the open seed line (``bf16_lean interrupted``) and return the one-line message: the signal,
        the run it stopped, the runs kept, and what running the same command again does with them."""
        kept = [(p, s) for p, s, out, cfg in self.plan if self.finished(out, cfg)]
        stopped = self.current if self.current not in kept else None  # a run that finished is kept
        if self.line_open:
            state = "interrupted" if stopped else "finished"
            self.end(f"{self.current[0]} {state}" if self.current else "", last=True)
        name = signal.Signals(signum).name
        step = getattr(err, "step", None)  # RunInterrupted: the step the run stopped after
        if stopped is not None:
            where = f"while training precision={stopped[0]} seed={stopped[1]}"
            where += f" (it stopped after step {step})" if step is not None else ""
        elif not kept:
            where = "before the first run finished"
        else:
            where = "after the last run finished" if len(kept) == self.total else "between two runs"
        left = self.total - len(kept)
        todo = ["reuses those"] if kept else []
        if left:
            trains = f"trains the other {left}" if kept else f"trains all {left}"
            todo.append(trains + (f" (precision={stopped[0]} seed={stopped[1]} from step 0)" if stopped else ""))
        again = "without --fresh" if self.fresh and kept else "again"
        return (
            f"amp-gate: interrupted by {name} {where}; {len(kept)} of {self.total} runs are finished in "
            f"{self.directory} and kept. To go on, run the same command {again}: it {', '.join(todo)} and writes "
            f"the report (exit {128 + signum})."
        )
