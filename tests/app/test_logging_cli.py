"""Lightning's log lines under ``python train.py``: once on the console, in Hydra's format, and in the
job's ``train.log`` (Lightning's own console handlers printed every INFO line a second time)."""

from __future__ import annotations

import logging

import pytest
from _cli_procs import run

from amp_plugin.app.cli import LIGHTNING_LOGGERS, route_lightning_logs


@pytest.mark.slow
def test_lightning_info_lines_print_once_and_reach_the_log_file(tmp_path):
    proc = run(
        ["trainer.max_steps=2", "hydra.run.dir=run", "plot=false", "trainer.enable_progress_bar=false"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = proc.stdout + proc.stderr
    assert console.count("GPU available") == 1, console[-3000:]
    assert "[lightning.pytorch" in console  # Hydra's format, with the logger's name
    assert (tmp_path / "run" / "train.log").read_text().count("GPU available") == 1


def test_routing_keeps_file_handlers_and_propagates():
    logger = logging.getLogger("lightning.pytorch")
    saved = list(logger.handlers), logger.propagate
    stream, file = logging.StreamHandler(), logging.FileHandler("/dev/null")
    logger.handlers[:] = [stream, file]
    logger.propagate = False
    try:
        route_lightning_logs()
        assert logger.handlers == [file] and logger.propagate
        assert "pytorch_lightning" in LIGHTNING_LOGGERS
    finally:
        file.close()
        logger.handlers[:], logger.propagate = saved
