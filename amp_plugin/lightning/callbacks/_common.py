"""What the diagnostic callbacks share: find the plugin, find the log dir, write CSV rows.

CSV files are written by global rank 0 only, one ``open(..., "a")`` per write followed by a
flush, so a run that crashes keeps every row written before the crash.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from amp_plugin.lightning.namespace import rank_zero_warn
from amp_plugin.lightning.plugin import MixedPrecisionPlugin

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CsvLog", "find_plugin", "run_log_dir"]


def find_plugin(trainer: pl.Trainer, owner: Any, consequence: str) -> MixedPrecisionPlugin | None:
    """The trainer's :class:`MixedPrecisionPlugin`, or ``None``: then warn once per ``owner``
    that it is missing and what ``owner`` does instead (``consequence``)."""
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin):
        return plugin
    if not getattr(owner, "_warned_no_plugin", False):
        owner._warned_no_plugin = True
        rank_zero_warn(
            f"{type(owner).__name__} reads the state of amp_plugin's MixedPrecisionPlugin, but this "
            f"trainer uses {type(plugin).__name__} (precision={getattr(plugin, 'precision', '?')!r}). "
            f"{consequence} Pass plugins=[MixedPrecisionPlugin(...)] to the Trainer.",
            category=UserWarning,
        )
    return None


def run_log_dir(trainer: pl.Trainer) -> str:
    """``trainer.log_dir``, or ``trainer.default_root_dir`` when there is no logger or the
    logger has no directory. A collective under DDP: call it on every rank."""
    path = trainer.log_dir
    return os.fspath(path) if path else os.fspath(trainer.default_root_dir)


class CsvLog:
    """A CSV file with a fixed header that grows by appended rows (rank 0 writes, others no-op).

    Args:
        filename: the file name inside the run's log dir.
        header: the column names.
    """

    def __init__(self, filename: str, header: Sequence[str]) -> None:
        self.filename = filename
        self.header = list(header)
        self.path: str | None = None
        self._writer_rank = False

    def start(
        self,
        trainer: pl.Trainer,
        rows: Iterable[Sequence[Any]] = (),
        keep_existing: Callable[[dict[str, str]], bool] | None = None,
    ) -> None:
        """(Re)create the file in the run's log dir: the header, then ``rows``.

        With ``keep_existing``, rows of an existing file with the same header for which it
        returns ``True`` are kept, before ``rows``. Call on every rank (resolving the log
        dir is a collective under DDP); only global rank 0 touches the file.
        """
        self.path = os.path.join(run_log_dir(trainer), self.filename)
        self._writer_rank = trainer.is_global_zero
        if not self._writer_rank:
            return
        kept: list[list[str]] = []
        if keep_existing is not None and os.path.isfile(self.path):
            with open(self.path, newline="") as f:
                reader = csv.reader(f)
                if next(reader, None) == self.header:
                    kept = [r for r in reader if keep_existing(dict(zip(self.header, r)))]
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.header)
            writer.writerows(kept)
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def append(self, rows: Iterable[Sequence[Any]]) -> None:
        """Append rows and flush them to disk (no-op off rank 0 or before :meth:`start`)."""
        if not self._writer_rank or self.path is None:
            return
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows(rows)
            f.flush()
