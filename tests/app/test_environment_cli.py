"""What only the environment gets wrong: disks, permissions, stray variables, damaged files, sweeps.

Every case runs the CLI in a subprocess, as a user would, and expects one message that names the
file, key or variable and what to do: no traceback, and never exit status 0 after a failure.

- A full disk is simulated with ``RLIMIT_FSIZE`` set in the child (``SIGXFSZ`` ignored), so a
  write past the limit fails with ``EFBIG`` as a full disk fails with ``ENOSPC``.
- A read-only directory: ``chmod`` for a normal user; as root, which ignores permission bits,
  ``chattr +i`` (skipped where the file system has no immutable flag).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_procs import QUIET, env, run

from amp_plugin.app.plots import write_history

TINY = ["recipe=underflow_demo", "trainer.max_steps=3", *QUIET]


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------- disks and permissions
def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_disk_that_fills_while_saving_stops_with_the_file_and_the_fix(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(
        [
            "trainer.max_steps=6",
            "callbacks.model_checkpoint.every_n_train_steps=2",
            "trainer.limit_val_batches=1",
            *QUIET,
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        preexec_fn=_file_size_limit(64 * 1024),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    no_traceback(proc)
    # The first checkpoint is the recovery checkpoint of the starting state.
    assert (
        f"Training stopped: Could not write the checkpoint {run_dir}/checkpoints/last-good.ckpt: "
        "[Errno 27] File too large. Fix: the file size limit is reached"
    ) in proc.stderr
    assert not list((run_dir / "checkpoints").iterdir())  # no partial file left behind
    assert "CheckpointWriteError" in (run_dir / "FAILED").read_text()


@contextlib.contextmanager
def read_only(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("running as root without chattr +i: no way to make a directory read-only here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sub, key", [("logs", "logger.save_dir"), ("checkpoints", "callbacks.model_checkpoint.dirpath")]
)
def test_a_read_only_log_or_checkpoint_directory_is_found_before_training(tmp_path, sub, key):
    run_dir = tmp_path / "run"
    with read_only(run_dir / sub):
        proc = run([*TINY, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    no_traceback(proc)
    assert f"Invalid configuration: {key}: the run cannot write to {run_dir / sub} ([Errno" in proc.stderr
    assert "amp_plugin: precision=" not in proc.stdout + proc.stderr  # no step was trained
    assert not (run_dir / "summary.json").exists()


# ---------------------------------------------------------------------------------- the environment
@pytest.mark.slow
def test_a_stray_local_rank_is_refused_instead_of_dropping_the_metrics(tmp_path):
    proc = run([*TINY, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, extra_env={"LOCAL_RANK": "1"})
    assert proc.returncode == 1
    no_traceback(proc)
    assert "Invalid configuration: LOCAL_RANK=1 is set in the environment, but this is a single process" in proc.stderr
    assert "Unset LOCAL_RANK" in proc.stderr


@pytest.mark.slow
def test_a_config_dir_that_does_not_exist_is_an_error(tmp_path):
    missing = tmp_path / "no_such_dir"
    proc = run(
        [*TINY],
        tmp_path,
        entry=[sys.executable, "-m", "amp_plugin.app.cli"],
        extra_env={"AMP_PLUGIN_CONFIG_DIR": str(missing)},
    )
    assert proc.returncode == 1
    no_traceback(proc)
    assert f"Invalid configuration: AMP_PLUGIN_CONFIG_DIR={missing} is not a directory" in proc.stderr
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------- amp-compare
def _fake_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    write_history(
        [{"step": 1.0, "train_loss": 1.0, "loss_scale": 65536.0, "skipped_steps": 0.0, "lr": 0.1}],
        run_dir / "training_curves.csv",
    )
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "status": "ok",
                "precision": "fp16",
                "scaler": "dynamic",
                "recipe": "digits",
                "steps": 1,
                "final_metrics": {"train/loss": 1.0},
                "skipped_steps": 0,
                "loss_scale": {"start": 65536.0, "end": 65536.0},
                "wall_time_s": 1.0,
            }
        )
    )


def compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "amp_plugin.app.compare", *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_compare_names_damaged_files_and_refuses_a_file_as_out(tmp_path):
    sweep = tmp_path / "sweep"
    for name in ("0", "1", "2"):
        _fake_run(sweep / name)
    summary = sweep / "1" / "summary.json"
    summary.write_text(summary.read_text()[:40])  # truncated
    (sweep / "2" / "training_curves.csv").write_text("step,train_loss\n1,abc\n")

    proc = compare(str(sweep), "--no-plot", cwd=tmp_path)
    no_traceback(proc)
    assert proc.returncode == 1  # a run could not be read
    assert f"warning: {summary}: cannot read the summary" in proc.stderr
    assert f"warning: {sweep / '2' / 'training_curves.csv'}, line 2: could not convert" in proc.stderr
    assert "UNREADABLE" in proc.stdout and (sweep / "compare.csv").is_file()
    proc = compare(str(sweep / "2"), "--no-plot", cwd=tmp_path)  # a run whose curves alone are damaged
    assert proc.returncode == 1 and "could not convert" in proc.stderr

    out = tmp_path / "a_file"
    out.write_text("")
    proc = compare(str(sweep / "0"), "--out", str(out), cwd=tmp_path)
    no_traceback(proc)
    assert proc.returncode == 2
    assert f"error: --out {out} is a file; give a directory" in proc.stderr


# ---------------------------------------------------------------------------------- sweeps
@pytest.mark.slow
def test_a_sweep_job_that_crashes_is_listed_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run(
        [
            "-m",
            "recipe=underflow_demo",
            "trainer.max_steps=2,3",
            *QUIET,
            "+callbacks.boom._target_=_cli_procs.Boom",
            "+callbacks.boom.at_step=2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert proc.returncode == 1
    no_traceback(proc)
    assert "Job failed: RuntimeError: boom at step 2" in proc.stderr
    assert f"1 job(s) of this sweep failed:\n  {sweep / '1'}: RuntimeError: boom at step 2" in proc.stderr
    assert (sweep / "0" / "summary.json").is_file()
    failed = (sweep / "1" / "FAILED").read_text()
    assert failed.startswith("RuntimeError: boom at step 2") and "Traceback" in failed  # the details stay on disk
