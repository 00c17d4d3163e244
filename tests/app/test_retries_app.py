"""Retries in the app: ``scaler.retries=N`` on the command line, counted in ``summary.json``,
the run summary and ``amp-compare``."""

from __future__ import annotations

import json

import pytest
from test_app import QUICK

from amp_plugin.app.compare import collect_runs, format_table
from amp_plugin.app.report import format_summary
from amp_plugin.app.run import train


@pytest.mark.slow
def test_a_retried_then_skipped_batch_is_counted_everywhere(tmp_path, capsys, compose_config):
    # the injected inf comes back on the retry too: one retry, then the skip
    result = train(compose_config("scaler.retries=1", "+fault.inject_inf_at=[1]", *QUICK, output_dir=tmp_path))
    assert (result["retried_steps"], result["skipped_steps"], result["steps"]) == (1, 1, 3)
    assert result["wasted_compute"] == 0.5  # 2 of 4 passes (3 steps and 1 retry) updated nothing
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["retried_steps"], summary["wasted_compute"]) == (1, 0.5)
    printed = format_summary(summary)
    assert "  retried      1 batches run again at a lower scale" in printed
    assert "  wasted       50.0% of forward+backward passes updated nothing" in printed
    events = (tmp_path / "logs" / "scale_events.csv").read_text().splitlines()[1:]
    assert [row.split(",")[3] for row in events] == ["retry", "overflow"]
    header, _, row = format_table(collect_runs([tmp_path])).splitlines()[:3]
    columns = header.split()
    assert columns[columns.index("skipped") : columns.index("skipped") + 3] == ["skipped", "retried", "wasted"]
    at = columns.index("skipped")
    assert row.split()[at : at + 3] == ["1", "1", "50.0%"]
