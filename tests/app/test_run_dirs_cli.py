"""Run directories through ``train.py``: never shared by two runs, never silently overwritten.

- Runs started at the same moment get their own default directories.
- A run into a directory another live run writes to is refused with one line; the live run's
  files are untouched, and once it is gone (even by SIGKILL) the directory can be resumed.
- A run into a finished run's directory is refused unless it resumes it or says overwrite=true.
"""

from __future__ import annotations

import csv
import json
import signal
from pathlib import Path

import pytest
import torch
from _cli_batch import run_batch
from _cli_procs import QUIET, run, start, throttle, wait_until
from omegaconf import OmegaConf

TINY = ["recipe=underflow_demo", "trainer.max_steps=3", *QUIET]


def rows_have_header_width(path: Path) -> bool:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return len(rows) > 1 and all(len(row) == len(rows[0]) for row in rows)


@pytest.mark.slow
def test_runs_started_together_get_their_own_directories(tmp_path):
    logs = [tmp_path / f"run{seed}.log" for seed in (1, 2)]
    procs = [start([*TINY, f"seed={seed}"], tmp_path, log) for seed, log in zip((1, 2), logs)]
    for proc, log in zip(procs, logs):
        proc.wait(timeout=300)
        assert proc.returncode == 0, log.read_text()[-3000:]
    dirs = sorted(p.parent for p in (tmp_path / "outputs").rglob("summary.json"))
    assert len(dirs) == 2, dirs
    seeds = set()
    for run_dir in dirs:
        config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["seed"] == config.seed and summary["output_dir"] == str(run_dir)
        assert rows_have_header_width(run_dir / "logs" / "metrics.csv")
        seeds.add(config.seed)
    assert seeds == {1, 2}


@pytest.mark.slow
def test_a_run_into_a_directory_in_use_is_refused_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "shared"
    log = tmp_path / "first.log"
    first = start(
        [
            "trainer.max_steps=200",
            "callbacks.model_checkpoint.every_n_train_steps=2",
            *QUIET,
            *throttle(0, 0.2),
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        log,
    )
    try:
        wait_until(lambda: (run_dir / "checkpoints" / "last.ckpt").is_file(), first)
        config_before = (run_dir / ".hydra" / "config.yaml").read_text()
        second = run([*TINY, f"hydra.run.dir={run_dir}"], tmp_path)
        assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert (
            f"hydra.run.dir={run_dir} is in use by a run that is still writing to it (pid {first.pid}" in second.stderr
        )
        assert "Traceback" not in second.stderr
        assert (run_dir / ".hydra" / "config.yaml").read_text() == config_before  # not rewritten
        assert not (run_dir / "FAILED").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # The lock died with the process: the directory resumes in place.
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    resumed = run(
        [
            f"trainer.max_steps={step + 2}",
            *QUIET,
            f"ckpt_path={run_dir}/checkpoints/last.ckpt",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == step + 2


@pytest.mark.slow
def test_a_finished_run_is_never_overwritten_silently(tmp_path):
    results = run_batch(
        tmp_path,
        [
            {"kind": "run", "name": "first", "dir": "done", "args": [*TINY, "seed=1"]},
            {"kind": "python", "code": "import shutil; shutil.copytree('done', 'done_copy', symlinks=True)"},
            {"kind": "run", "name": "again", "dir": "done", "args": [*TINY, "seed=2"]},
            {
                "kind": "run",
                "name": "overwrite",
                "dir": "done_copy",
                "args": [*TINY, "seed=3", "trainer.max_steps=4", "overwrite=true"],
            },
        ],
    )
    assert results["first"]["code"] in (0, None)
    done = tmp_path / "done"
    again = results["again"]
    assert again["code"] == 1
    assert (
        f"Run directory refused: hydra.run.dir={done} already holds a finished run "
        "(summary.json, training_curves.csv, logs, checkpoints)"
    ) in again["stderr"]
    assert f"resume it with ckpt_path={done}/checkpoints/last.ckpt" in again["stderr"]
    assert "overwrite=true" in again["stderr"] and "Traceback" not in again["stderr"]
    assert json.loads((done / "summary.json").read_text())["seed"] == 1  # summary, config: the first run's
    assert OmegaConf.load(done / ".hydra" / "config.yaml").seed == 1
    assert not (done / "FAILED").exists()

    # overwrite=true replaces the old run: no last-v1.ckpt, the summary names this run's files.
    replaced = tmp_path / "done_copy"
    assert results["overwrite"]["code"] in (0, None), results["overwrite"]["stderr"][-3000:]
    summary = json.loads((replaced / "summary.json").read_text())
    assert summary["seed"] == 3
    assert sorted(p.name for p in (replaced / "checkpoints").iterdir()) == [
        "epoch0-step4.ckpt",
        "last-good.ckpt",
        "last.ckpt",
    ]
    assert torch.load(summary["paths"]["last_checkpoint"], weights_only=False)["global_step"] == 4


@pytest.mark.slow
def test_tensorboard_resumed_in_place_hides_what_the_interrupted_run_logged_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = [
        "logger=tensorboard",
        "trainer.log_every_n_steps=1",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        "callbacks.model_checkpoint.save_top_k=-1",
        *QUIET,
    ]
    results = run_batch(
        tmp_path,
        [
            {"kind": "run", "name": "first", "dir": "tb", "args": [*common, "trainer.max_steps=5"]},
            # As if the run had been killed after step 5: resume from its step-2 checkpoint, in place.
            {"kind": "python", "code": "import os; os.remove('tb/summary.json')"},
            {
                "kind": "run",
                "name": "resumed",
                "dir": "tb",
                "args": [*common, "trainer.max_steps=6", f"ckpt_path={tmp_path}/tb/checkpoints/epoch0-step2.ckpt"],
            },
        ],
    )
    assert results["resumed"]["code"] in (0, None), results["resumed"]["stderr"][-3000:]
    events = EventAccumulator(str(tmp_path / "tb" / "logs"))
    events.Reload()
    steps = [event.step for event in events.Scalars("train/loss")]
    assert steps == list(range(6))  # 2, 3 and 4 of the first run are purged, each step once
