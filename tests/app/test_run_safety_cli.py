"""Runs that never lose data and never report a failure as a success, through the CLI.

``overwrite=true`` deletes only what a run wrote; a sweep never touches a live run's directory;
resuming in place takes only the run's own checkpoints, and only undamaged ones; a run that
ends without training fails; bad input that Lightning would take (or hang on) is refused
before training with one line; SIGTERM before the first step leaves a ``FAILED`` note.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_batch import run_batch
from _cli_procs import QUIET, ROOT, env, logged_steps, run, start, throttle, wait_until

from amp_plugin.lightning import pl

# Under pytest-xdist the tests that read the module's batch of CLI runs stay on one worker.
pytestmark = pytest.mark.xdist_group("run_safety_cli")

TINY = ["recipe=underflow_demo", "trainer.max_steps=3", "trainer.limit_val_batches=1", *QUIET]


class SlowSetup(pl.Callback):
    """Between building the Trainer and the first step: write ``marker``, then wait."""

    def __init__(self, marker: str, seconds: float) -> None:
        self.marker, self.seconds = marker, seconds

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        Path(self.marker).write_text("setting up\n")
        time.sleep(self.seconds)


def one_line_refusal(result: dict[str, Any], *named: str) -> str:
    """The refusal's message: exit 1, no traceback, the names in one line."""
    output = result["stderr"] + result["stdout"]
    assert result["code"] == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = next((line for line in result["stderr"].splitlines() if all(n in line for n in named)), None)
    assert line is not None, result["stderr"][-3000:]
    return line


def flip_bytes(src: str | Path, dst: str | Path, count: int = 64) -> None:
    """Flip ``count`` bytes in the middle of the largest tensor's data (``torch.load`` checks none)."""
    import zipfile

    with zipfile.ZipFile(src) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(Path(src).read_bytes())
    header = entry.header_offset  # the local file header: 30 bytes, then the name and the extra field
    name_len = int.from_bytes(data[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(data[header + 28 : header + 30], "little")
    first = header + 30 + name_len + extra_len + max(0, entry.file_size // 2 - count // 2)
    for i in range(first, first + min(count, entry.file_size)):
        data[i] ^= 0xFF
    Path(dst).write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    work = tmp_path_factory.mktemp("safety")
    prepare = (
        "from pathlib import Path\n"
        + inspect.getsource(flip_bytes)
        + """
import shutil, torch
from pathlib import Path
shutil.copy("b/checkpoints/last.ckpt", "a/checkpoints/from_b.ckpt")
flip_bytes("a/checkpoints/last.ckpt", "flipped.ckpt")
ckpt = torch.load("a/checkpoints/last.ckpt", weights_only=False)
ckpt["amp_plugin"]["scaler"]["scale"] = float("nan")
ckpt.pop("amp_plugin_checksum")
torch.save(ckpt, "nan_scale.ckpt")
for name in ("foreign/logs/notes.txt", "foreign/checkpoints/pretrained.pt"):
    Path(name).parent.mkdir(parents=True, exist_ok=True)
    Path(name).write_text("mine")
"""
    )
    ops = [
        {"kind": "run", "name": "a", "args": TINY},
        {"kind": "run", "name": "b", "args": [*TINY, "seed=1"]},
        {"kind": "python", "code": prepare},
        {"kind": "run", "name": "foreign", "args": [*TINY, "overwrite=true"]},
        {
            "kind": "run",
            "name": "other_run_in_place",
            "dir": "a",
            "args": [*TINY, "trainer.max_steps=5", "ckpt_path=a/checkpoints/from_b.ckpt"],
        },
        {"kind": "run", "name": "flipped", "args": [*TINY, "trainer.max_steps=5", "ckpt_path=flipped.ckpt"]},
        {"kind": "run", "name": "nan_scale", "args": [*TINY, "trainer.max_steps=5", "ckpt_path=nan_scale.ckpt"]},
        {"kind": "run", "name": "val_check_0", "args": [*TINY, "trainer.val_check_interval=0"]},
        {"kind": "run", "name": "clip_nan", "args": [*TINY, "trainer.gradient_clip_val=nan"]},
        {"kind": "run", "name": "limit_0", "args": [*TINY, "trainer.limit_train_batches=0"]},
        {"kind": "run", "name": "epochs_0", "args": [*TINY, "trainer.max_steps=-1", "trainer.max_epochs=0"]},
        {"kind": "run", "name": "nodes_2", "args": [*TINY, "trainer.num_nodes=2", "strategy=ddp"]},
        {
            "kind": "run",
            "name": "stalled",
            "args": [
                *TINY,
                "trainer.max_steps=6",
                "+fault.inject_inf_from=1",
                "scaler.on_min_scale=skip",
                "scaler.init_scale=4",
                "scaler.min_scale=1",
            ],
        },
    ]
    return work, run_batch(work, ops)


@pytest.mark.slow
def test_overwrite_refuses_a_directory_holding_files_no_run_wrote(runs):
    work, results = runs
    line = one_line_refusal(results["foreign"], "overwrite=true", "logs/notes.txt")
    assert "checkpoints/pretrained.pt" in line
    assert (work / "foreign/logs/notes.txt").read_text() == "mine"
    assert (work / "foreign/checkpoints/pretrained.pt").read_text() == "mine"
    assert not (work / "foreign/summary.json").exists()


@pytest.mark.slow
def test_resuming_in_place_from_another_runs_checkpoint_is_refused_before_anything_is_written(runs):
    work, results = runs
    line = one_line_refusal(results["other_run_in_place"], "from_b.ckpt", "not allowed in place")
    run_a = json.loads((work / "a/.amp_run").read_text())["run_id"]
    run_b = json.loads((work / "b/.amp_run").read_text())["run_id"]
    assert f"run {run_b}" in line and f"run {run_a}" in line
    summary = json.loads((work / "a/summary.json").read_text())
    assert summary["global_step"] == 3 and summary["resumed_from"] is None  # a's own history stands
    assert "trainer.max_steps=5" not in (work / "a/.hydra/overrides.yaml").read_text()


@pytest.mark.slow
def test_a_checkpoint_with_flipped_bytes_is_refused_before_training(runs):
    work, results = runs
    line = one_line_refusal(results["flipped"], "flipped.ckpt", "checksum")
    assert "ckpt_path=" in line
    assert not (work / "flipped/summary.json").exists() and not (work / "flipped/logs").exists()


@pytest.mark.slow
def test_a_checkpoint_with_a_nan_loss_scale_names_ckpt_path(runs):
    work, results = runs
    line = one_line_refusal(results["nan_scale"], "ckpt_path='nan_scale.ckpt'", "loss scale")
    assert "nan" in line
    assert not (work / "nan_scale/logs").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, key",
    [
        ("val_check_0", "trainer.val_check_interval=0"),
        ("clip_nan", "trainer.gradient_clip_val=nan"),
        ("limit_0", "trainer.limit_train_batches=0"),
        ("epochs_0", "trainer.max_epochs=0"),
        ("nodes_2", "trainer.num_nodes=2"),
    ],
)
@pytest.mark.slow
def test_trainer_values_that_train_nothing_or_hang_are_refused_before_training(runs, name, key):
    _, results = runs
    line = one_line_refusal(results[name], key, "is not allowed")
    assert "must" in line or "Start it on each machine" in line
    listing = results[name]["listing"] or []
    assert not {"logs", "checkpoints", "summary.json"} & set(listing)


@pytest.mark.slow
def test_a_run_whose_last_steps_were_all_skipped_fails(runs):
    work, results = runs
    result = results["stalled"]
    line = one_line_refusal(result, "Training stopped", "were all skipped")
    assert "the last 5 of its 6 steps" in line
    summary = json.loads((work / "stalled/summary.json").read_text())
    assert summary["status"] == "failed" and "step 1 on" in summary["failure"]
    assert "were all skipped" in (work / "stalled/FAILED").read_text()


# ---------------------------------------------------------------------------------- run directories
@pytest.mark.slow
def test_an_empty_run_directory_is_refused(tmp_path):
    result = run([*TINY, "hydra.run.dir="], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "hydra.run.dir='' is not allowed" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written where it ran


def _read_only(path: Path) -> bool:
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def _writable(path: Path) -> None:
    if os.geteuid() != 0:
        path.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@pytest.mark.slow
def test_a_read_only_run_directory_is_refused_with_one_line(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if not _read_only(target):
        pytest.skip("cannot make a directory read-only here")
    try:
        result = run([*TINY, f"hydra.run.dir={target}"], tmp_path)
    finally:
        _writable(target)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"hydra.run.dir={target} cannot be written" in result.stderr
    assert list(target.iterdir()) == []


@pytest.mark.slow
def test_a_run_directory_deleted_mid_run_stops_with_one_line(tmp_path):
    run_dir, log = tmp_path / "doomed", tmp_path / "doomed.log"
    proc = start(["trainer.max_steps=200", *QUIET, *throttle(0, 0.2), f"hydra.run.dir={run_dir}"], tmp_path, log)
    try:
        wait_until(lambda: logged_steps(log), proc)
        time.sleep(0.5)
        shutil.rmtree(run_dir)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert f"hydra.run.dir={run_dir} was deleted while the run was writing to it" in output
    assert not run_dir.exists()  # nothing written again (a checkpoint save would recreate it)


def _hold(directory: Path) -> subprocess.Popen:
    """A process that holds ``directory``'s run lock, as a live run does."""
    code = (
        "import sys, time; from amp_plugin.app import rundir; rundir.claim(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_sweep_never_touches_a_live_runs_directory(tmp_path):
    sweep = tmp_path / "sweep"
    live = sweep / "0"
    (live / ".hydra").mkdir(parents=True)
    (live / ".hydra" / "config.yaml").write_text("precision: fp16\n")
    (live / "checkpoints").mkdir()
    (live / "checkpoints" / "last.ckpt").write_text("live")
    (live / "logs").mkdir()
    (live / "logs" / "metrics.csv").write_text("step\n")
    (live / ".amp_run").write_text('{"run_id": "live"}\n')
    holder = _hold(live)
    try:
        results = {
            flag: run(["-m", *TINY, "seed=1,2", f"hydra.sweep.dir={sweep}", *flag.split()], tmp_path)
            for flag in ("overwrite=true", "overwrite=false")
        }
    finally:
        holder.kill()
        holder.wait()
    for flag, result in results.items():
        assert result.returncode == 1, (flag, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"holds {live}, the directory of a run that is still writing to it" in result.stderr, flag
    assert (live / "checkpoints" / "last.ckpt").read_text() == "live"
    assert (live / "logs" / "metrics.csv").read_text() == "step\n"
    assert (live / ".hydra" / "config.yaml").read_text() == "precision: fp16\n"  # not rewritten by Hydra
    assert not (sweep / "1").exists()


def test_a_refused_sweep_job_counts_as_failed(tmp_path, capsys):
    from omegaconf import OmegaConf

    from amp_plugin.app import rundir
    from amp_plugin.app.cli import SweepFailures
    from amp_plugin.app.outcome import report_end

    job = tmp_path / "0"
    job.mkdir()
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    report_end(rundir.RunDirError(f"hydra.run.dir={job} is in use"), cfg, job, multirun=True)
    assert not (job / "FAILED").exists()  # not the refused job's directory to write into
    with pytest.raises(SystemExit) as stop:
        SweepFailures().on_multirun_end(cfg)
    assert stop.value.code == 1
    assert f"1 job(s) of this sweep failed:\n  {job}: Run directory refused" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- signals
@pytest.mark.slow
def test_sigterm_before_the_first_step_leaves_a_failed_note(tmp_path):
    run_dir, log, marker = tmp_path / "early", tmp_path / "early.log", tmp_path / "setting-up"
    args = [
        *TINY,
        "+callbacks.slow._target_=test_run_safety_cli.SlowSetup",
        f"+callbacks.slow.marker={marker}",
        "+callbacks.slow.seconds=60",
        f"hydra.run.dir={run_dir}",
    ]
    proc = start(args, tmp_path, log)
    try:
        wait_until(marker.is_file, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, log.read_text()[-3000:]
    note = (run_dir / "FAILED").read_text()
    assert note.startswith("Interrupted by SIGTERM before training started; no new checkpoint was written.")
    assert "Exit status 143 (128 + SIGTERM)." in note
    assert "Traceback" not in log.read_text()


# ---------------------------------------------------------------------------------- checksums
def test_the_checksum_covers_the_tensor_data(tmp_path):
    from amp_plugin._checksum import verify_checksum
    from amp_plugin.lightning.checkpoint_io import atomic_save

    checkpoint = {"state_dict": {"w": torch.arange(4096, dtype=torch.float32)}, "global_step": 7, "x": [1.5, "a"]}
    atomic_save(checkpoint, tmp_path / "c.ckpt")
    assert verify_checksum(torch.load(tmp_path / "c.ckpt", weights_only=False)) is True
    flip_bytes(tmp_path / "c.ckpt", tmp_path / "d.ckpt")
    assert verify_checksum(torch.load(tmp_path / "d.ckpt", weights_only=False)) is False  # loads fine, but damaged
    assert verify_checksum(checkpoint) is None  # written without a checksum (Lightning's own CheckpointIO)


@pytest.mark.slow
def test_a_refused_run_and_a_finished_sweep_leave_no_lock_file(tmp_path):
    """The lock file lives while a run or a sweep writes (docs/runs.md). A run refused by the directory
    check (a finished run's directory, no ``overwrite``) exited holding it, and a sweep never dropped
    its own: a ``.lock`` stayed behind in both, one more file in a directory a refused run must leave
    as it was."""
    finished = tmp_path / "finished"
    assert run([*TINY, f"hydra.run.dir={finished}"], tmp_path).returncode == 0
    assert not (finished / ".lock").exists()
    refused = run([*TINY, f"hydra.run.dir={finished}"], tmp_path)
    assert refused.returncode == 1 and "already holds a finished run" in refused.stderr
    assert not (finished / ".lock").exists()
    sweep = tmp_path / "sweep"
    assert run(["-m", *TINY, "seed=1,2", f"hydra.sweep.dir={sweep}"], tmp_path).returncode == 0
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]


@pytest.mark.parametrize("run_file", [None, "not json", '{"run_id": 7}'], ids=["none", "garbage", "no_id"])
def test_overwrite_of_outputs_no_run_file_vouches_for_says_why(tmp_path, run_file):
    """``overwrite=true`` on outputs whose ``.amp_run`` is missing or unreadable is refused, and the message
    says which of the two (it said "there is no .amp_run file" beside a damaged one)."""
    from amp_plugin.app.reuse import check_reuse
    from amp_plugin.app.rundir import RunDirError

    (tmp_path / "summary.json").write_text("{}")
    if run_file is not None:
        (tmp_path / ".amp_run").write_text(run_file)
    why = "there is none" if run_file is None else "it is unreadable"
    with pytest.raises(RunDirError, match=rf"no \.amp_run file says which run wrote its summary\.json \({why}\)"):
        check_reuse(tmp_path, None, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["summary.json"] + ([".amp_run"] if run_file else []))


@pytest.mark.slow
def test_a_local_sweep_of_multi_process_jobs_fails_each_job_in_one_line(tmp_path):
    """``-m`` with ``trainer.devices=2``: Lightning starts a job's second process with the sweep's command line,
    ``-m`` included, which started the sweep again, was refused by the sweep's lock, and Lightning killed the
    sweep (exit 137, no FAILED note). Each job is refused before it starts a process, and the sweep goes on."""
    sweep = tmp_path / "sweep"
    result = run(
        [
            "-m",
            *TINY,
            "seed=1,2",
            "strategy=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "2 job(s) of this sweep failed" in result.stderr
    for job in ("0", "1"):
        note = (sweep / job / "FAILED").read_text()
        assert "trainer.devices=2 is not allowed in a sweep (-m) run by Hydra's local launcher" in note
        assert not (sweep / job / "checkpoints").exists()
