"""The statistics of ``amp-gate``: paired differences, their standard error, and the verdict.

For each judged metric the gate has one value per seed for the candidate (A) and the reference
(B), trained with the same seed. With ``d_i = A_i - B_i`` over ``N`` seeds:

- the paired difference is ``mean(d)``;
- its standard error is ``SE = std(d) / sqrt(N)`` (``std`` with ``N - 1`` degrees of freedom);
- the harm is the difference in the bad direction: ``mean(d)`` for a metric where lower is
  better (a loss), ``-mean(d)`` where higher is better (an accuracy);
- the noise band is ``max(sigmas * SE, tolerance * |mean(B)|)``: ``sigmas`` standard errors
  (default 2, about a 95% interval), or a relative tolerance where that is wider (default 0);
- the verdict is ``within noise`` when ``|harm| <= band``, ``worse`` when ``harm > band`` and
  ``better`` when ``harm < -band``; ``undecided`` when the band is 0 (every ``d_i`` equal, so
  ``SE = 0``, and no tolerance) while the difference is not: there is no noise estimate to judge by;
  also ``undecided`` when the difference, the SE or the band is not finite (values so large that
  their differences overflow): a NaN compares false with everything, and must not pass the gate.
  ``sigmas`` and ``tolerance`` are finite and ``>= 0`` (an infinite band would pass any candidate).

A metric that is not finite in a run of A is ``worse``; one not finite in B (while A's are) is
``better``. The gate's overall verdict is ``worse`` when any metric is, else ``undecided`` when any
metric is, else ``better`` when any metric is, else ``within noise``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["DIRECTIONS", "MetricVerdict", "Verdict", "direction_of", "judge", "overall", "paired_difference"]

Verdict = Literal["within noise", "better", "worse", "undecided"]

DIRECTIONS: dict[str, Literal["lower", "higher"]] = {"val/loss": "lower", "val/acc": "higher"}
"""The metrics the gate judges, and which way is better. Add an entry to judge another."""


def direction_of(metric: str) -> Literal["lower", "higher"] | None:
    """Which way ``metric`` is better, or None when the gate does not judge it."""
    return DIRECTIONS.get(metric)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """``(mean(a - b), std(a - b) / sqrt(N))`` over paired values (``std`` with ``N - 1``).

    Args:
        a: the candidate's values, one per seed.
        b: the reference's values, the same seeds in the same order.

    Raises:
        ValueError: ``a`` and ``b`` differ in length, or hold fewer than 2 pairs.
    """
    if len(a) != len(b):
        raise ValueError(f"a has {len(a)} values and b has {len(b)}: the gate needs one pair per seed.")
    if len(a) < 2:
        raise ValueError(f"{len(a)} pair(s): a standard error needs at least 2 paired seeds.")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = math.fsum(diffs) / n
    var = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var) / math.sqrt(n)


@dataclass(frozen=True)
class MetricVerdict:
    """One metric's comparison (see the module docstring for the definitions)."""

    metric: str
    direction: Literal["lower", "higher"]
    a: list[float | None]
    b: list[float | None]
    mean_a: float | None
    mean_b: float | None
    diff: float | None  # mean(A - B)
    se: float | None
    band: float | None
    harm: float | None  # the difference in the bad direction
    verdict: Verdict
    notes: list[str] = field(default_factory=list)

    @property
    def relative(self) -> float | None:
        """The paired difference relative to the reference's mean (``diff / |mean_b|``)."""
        if self.diff is None or not self.mean_b:
            return None
        return self.diff / abs(self.mean_b)

    def describe(self) -> str:
        """``within noise``, ``better by ...`` or ``worse by X (+1.2%, 3.1 SE)``."""
        if self.verdict in ("within noise", "undecided") or self.harm is None:
            return self.verdict if not self.notes else f"{self.verdict} ({'; '.join(self.notes)})"
        parts = []
        if self.relative is not None:
            parts.append(f"{100 * self.relative:+.2f}%")
        if self.se:
            parts.append(f"{abs(self.harm) / self.se:.1f} SE")
        return f"{self.verdict} by {abs(self.harm):.4g}" + (f" ({', '.join(parts)})" if parts else "")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "relative": self.relative, "text": self.describe()}


def _finite(values: Sequence[float | None]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def judge(
    metric: str,
    a: Sequence[float | None],
    b: Sequence[float | None],
    sigmas: float = 2.0,
    tolerance: float = 0.0,
) -> MetricVerdict:
    """Compare one metric over paired seeds.

    Args:
        metric: its name (a key of :data:`DIRECTIONS`).
        a: the candidate's final values, one per seed (None or NaN: the run ended non-finite).
        b: the reference's, same seeds in the same order.
        sigmas: the noise band in standard errors of the paired difference.
        tolerance: the noise band relative to ``|mean(b)|`` where that is wider.

    Raises:
        ValueError: an unknown metric, unpaired values, or a ``sigmas``/``tolerance`` that is negative or
            not finite (an infinite band would pass every candidate; ``inf * 0`` is NaN).
    """
    direction = direction_of(metric)
    if direction is None:
        raise ValueError(f"metric={metric!r} is not judged; allowed: {sorted(DIRECTIONS)}.")
    for name, value in (("sigmas", sigmas), ("tolerance", tolerance)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value}: allowed values are finite numbers >= 0 (not nan or inf).")
    a, b = list(a), list(b)
    if not (_finite(a) and _finite(b)):
        bad, values = ("A", a) if not _finite(a) else ("B", b)
        verdict: Verdict = "worse" if bad == "A" else "better"
        note = f"{bad} ended with a non-finite {metric} in {sum(not _finite([v]) for v in values)} run(s)"
        return MetricVerdict(metric, direction, a, b, None, None, None, None, None, None, verdict, [note])
    fa, fb = [float(v) for v in a if v is not None], [float(v) for v in b if v is not None]
    diff, se = paired_difference(fa, fb)
    mean_a, mean_b = math.fsum(fa) / len(fa), math.fsum(fb) / len(fb)
    harm = diff if direction == "lower" else -diff
    band = max(sigmas * se, tolerance * abs(mean_b))
    verdict, notes = _verdict(harm, se, band)
    return MetricVerdict(metric, direction, a, b, mean_a, mean_b, diff, se, band, harm, verdict, notes)


def _verdict(harm: float, se: float, band: float) -> tuple[Verdict, list[str]]:
    """The verdict on ``harm`` against ``band``, and its notes. Each verdict needs its own comparison to hold
    (a NaN holds none): a difference, SE or band that is not finite (finite values so large that their
    differences overflow) is ``undecided``, which fails the gate, never ``within noise`` or ``better``."""
    if not all(math.isfinite(x) for x in (harm, se, band)):
        return "undecided", [f"the difference ({harm:g}), its SE ({se:g}) or the band ({band:g}) is not finite"]
    if band == 0 and harm != 0:
        return "undecided", ["every paired difference is the same: SE 0, no noise band"]
    if abs(harm) <= band:
        return "within noise", []
    if harm > band:
        return "worse", []
    if harm < -band:
        return "better", []
    return "undecided", [f"the difference ({harm:g}) cannot be compared with the band ({band:g})"]


def overall(verdicts: Sequence[MetricVerdict]) -> Verdict:
    """``worse`` if any metric is, else ``undecided`` if any is, else ``better`` if any is, else ``within noise``."""
    kinds = {v.verdict for v in verdicts}
    order: tuple[Verdict, ...] = ("worse", "undecided", "better")
    return next((kind for kind in order if kind in kinds), "within noise")
