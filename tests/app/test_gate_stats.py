"""The gate's statistics and verdict (amp_plugin.app.gate_stats) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from amp_plugin.app.gate_stats import judge, overall, paired_difference


def test_paired_difference_is_the_mean_and_standard_error_of_the_per_seed_differences():
    # d = [0.1, -0.1, 0.2, 0.1]: mean 0.075; squared deviations 0.000625 + 0.030625 + 0.015625 + 0.000625
    # = 0.0475, / (N - 1) = 0.015833..., std 0.125830..., SE = std / sqrt(4) = 0.0629153
    mean, se = paired_difference([1.0, 2.0, 3.0, 4.0], [0.9, 2.1, 2.8, 3.9])
    assert mean == pytest.approx(0.075, abs=1e-12)
    assert se == pytest.approx(math.sqrt(0.0475 / 3) / 2, abs=1e-12)
    assert se == pytest.approx(0.0629153, abs=1e-7)


def test_paired_difference_refuses_unpaired_or_single_values():
    with pytest.raises(ValueError, match="a has 2 values and b has 3"):
        paired_difference([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="at least 2 paired seeds"):
        paired_difference([1.0], [1.0])


def test_a_loss_difference_inside_two_standard_errors_is_within_noise():
    v = judge("val/loss", [1.0, 2.0, 3.0, 4.0], [0.9, 2.1, 2.8, 3.9])
    assert v.verdict == "within noise" and v.direction == "lower"
    assert v.band == pytest.approx(2 * 0.0629153, abs=1e-6)  # 0.1258 >= harm 0.075
    assert v.harm == pytest.approx(0.075) and v.describe() == "within noise"
    assert v.mean_a == pytest.approx(2.5) and v.mean_b == pytest.approx(2.425)


def test_a_loss_above_the_band_is_worse_by_its_difference():
    # d = [0.1, 0.12, 0.08, 0.1]: mean 0.1, sum of squared deviations 0.0008, SE = sqrt(0.0008 / 3) / 2
    v = judge("val/loss", [1.1, 1.12, 1.08, 1.1], [1.0, 1.0, 1.0, 1.0])
    se = math.sqrt(0.0008 / 3) / 2
    assert v.se == pytest.approx(se, abs=1e-12) and v.se == pytest.approx(0.00816497, abs=1e-8)
    assert v.verdict == "worse" and v.relative == pytest.approx(0.1)
    assert v.describe() == "worse by 0.1 (+10.00%, 12.2 SE)"  # 0.1 / 0.008165 = 12.25


def test_for_an_accuracy_higher_is_better():
    lower = judge("val/acc", [0.90, 0.91, 0.89, 0.90], [0.95, 0.95, 0.95, 0.95])  # d mean -0.05
    assert lower.direction == "higher" and lower.verdict == "worse" and lower.harm == pytest.approx(0.05)
    higher = judge("val/acc", [0.95, 0.95, 0.95, 0.95], [0.90, 0.91, 0.89, 0.90])
    assert higher.verdict == "better" and higher.describe().startswith("better by 0.05 (+5.")


def test_a_lower_loss_beyond_the_band_is_better():
    v = judge("val/loss", [1.0, 1.0, 1.0, 1.0], [1.1, 1.12, 1.08, 1.1])
    assert v.verdict == "better" and v.diff == pytest.approx(-0.1) and v.harm == pytest.approx(-0.1)


def test_identical_runs_are_within_noise_and_a_constant_shift_is_undecided():
    same = judge("val/loss", [1.0, 2.0], [1.0, 2.0])
    assert (same.diff, same.se, same.band, same.verdict) == (0.0, 0.0, 0.0, "within noise")
    shifted = judge("val/loss", [1.5, 2.5], [1.0, 2.0])  # every seed 0.5 worse: SE 0, band 0, no noise estimate
    assert shifted.se == 0.0 and shifted.verdict == "undecided"
    assert shifted.describe() == "undecided (every paired difference is the same: SE 0, no noise band)"
    assert judge("val/loss", [1.5, 2.5], [1.0, 2.0], tolerance=0.1).verdict == "worse"  # 0.5 > 10% of 1.5


def test_the_relative_tolerance_widens_the_band_where_it_is_wider():
    a, b = [1.02, 1.021, 1.019, 1.02], [1.0, 1.0, 1.0, 1.0]  # 2% worse, SE 0.00041
    assert judge("val/loss", a, b).verdict == "worse"
    within = judge("val/loss", a, b, tolerance=0.03)
    assert within.verdict == "within noise" and within.band == pytest.approx(0.03)
    assert judge("val/loss", a, b, tolerance=0.01).verdict == "worse"
    assert judge("val/loss", a, b, sigmas=100).verdict == "within noise"  # 100 SE = 0.041


def test_a_non_finite_metric_of_the_candidate_is_worse_and_of_the_reference_better():
    bad = judge("val/loss", [1.0, None, math.nan], [1.0, 1.0, 1.0])
    assert bad.verdict == "worse" and bad.diff is None
    assert bad.notes == ["A ended with a non-finite val/loss in 2 run(s)"]
    assert bad.describe() == "worse (A ended with a non-finite val/loss in 2 run(s))"  # no numbers to report
    assert judge("val/loss", [1.0, 1.0], [math.inf, 1.0]).verdict == "better"


def test_judge_refuses_unknown_metrics_and_negative_bands():
    with pytest.raises(ValueError, match=r"metric='train/loss' is not judged; allowed: \['val/acc', 'val/loss'\]"):
        judge("train/loss", [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"sigmas=-1: allowed values are finite numbers >= 0 \(not nan or inf\)"):
        judge("val/loss", [1.0, 1.0], [1.0, 1.0], sigmas=-1)


@pytest.mark.parametrize(("key", "value"), [("sigmas", math.inf), ("sigmas", math.nan), ("tolerance", math.inf)])
def test_judge_refuses_bands_that_are_not_finite(key, value):
    # sigmas=inf with SE 0 made a NaN band (inf * 0) and a difference of 0 "better"; tolerance=inf passed anything
    with pytest.raises(ValueError, match=rf"{key}={value}: allowed values are finite numbers >= 0"):
        judge("val/loss", [1.0, 1.0], [1.0, 1.0], **{key: value})


@pytest.mark.parametrize(("diff", "se"), [(0.0, math.nan), (math.nan, 0.1), (math.inf, math.nan), (-1.0, math.inf)])
@pytest.mark.parametrize("metric", ["val/loss", "val/acc"])
def test_a_difference_se_or_band_that_is_not_finite_is_undecided_never_a_pass(monkeypatch, metric, diff, se):
    import amp_plugin.app.gate_stats as stats

    monkeypatch.setattr(stats, "paired_difference", lambda a, b: (diff, se))  # as an overflow would leave them
    v = judge(metric, [1.0, 2.0], [1.0, 2.0], tolerance=0.01)
    assert v.verdict == "undecided", v
    assert v.describe().startswith("undecided (the difference (") and "is not finite" in v.describe()
    assert overall([v, judge("val/loss", [1.0, 2.0], [1.0, 2.0])]) == "undecided"  # the gate fails (exit 1)


def test_the_overall_verdict_is_the_worst_metric():
    worse = judge("val/loss", [1.5, 2.7], [1.0, 2.0])
    better = judge("val/acc", [0.9, 0.85], [0.8, 0.7])
    noise = judge("val/loss", [1.0, 2.0], [1.0, 2.0])
    undecided = judge("val/loss", [1.5, 2.5], [1.0, 2.0])
    assert (worse.verdict, better.verdict, undecided.verdict) == ("worse", "better", "undecided")
    assert overall([noise, better, undecided, worse]) == "worse"
    assert overall([noise, better, undecided]) == "undecided"
    assert overall([noise, better, worse]) == "worse"
    assert overall([noise, better]) == "better"
    assert overall([noise]) == "within noise"
