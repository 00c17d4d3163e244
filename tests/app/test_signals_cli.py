"""SIGTERM and SIGINT stop ``train.py`` the way a cluster scheduler expects.

A pre-empted run (SIGTERM, as SLURM and Kubernetes send it) or an interrupted one (SIGINT,
Ctrl+C) finishes its step, saves a checkpoint at that step, writes ``FAILED`` naming the signal,
the step and the exact resume command, and exits with 128 + the signal (143, 130). Running that
command resumes in place and keeps the logs of both parts, without duplicated or missing steps.
"""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _checkpoint_trees import differences
from _cli_procs import QUIET, env, logged_steps, start, throttle, wait_until

STEPS = 40


def metric_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def interrupt(tmp_path: Path, signum: int, extra: tuple[str, ...] = ()) -> tuple[Path, str, int]:
    """Start a throttled run, send ``signum`` after a few steps; return its dir, FAILED and exit status."""
    run_dir = tmp_path / signal.Signals(signum).name
    log = tmp_path / f"{run_dir.name}.log"
    proc = start(
        [
            f"trainer.max_steps={STEPS}",
            "trainer.log_every_n_steps=1",
            "trainer.limit_val_batches=2",
            *QUIET,
            *throttle(2, 0.25),
            *extra,
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        log,
    )
    wait_until(lambda: logged_steps(log), proc)  # training starts now
    time.sleep(1.5)  # a few (throttled) steps in
    proc.send_signal(signum)
    proc.wait(timeout=120)
    return run_dir, (run_dir / "FAILED").read_text() if (run_dir / "FAILED").exists() else "", proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_a_checkpoint_exits_128_plus_n_and_the_resume_command_continues(tmp_path, signum, status):
    run_dir, note, code = interrupt(tmp_path, signum)
    name = signal.Signals(signum).name
    assert code == status, note + (tmp_path / f"{name}.log").read_text()[-3000:]
    match = re.search(
        rf"Interrupted by {name} at step (\d+): the run stopped after that step and saved a "
        r"checkpoint\.",
        note,
    )
    assert match, note
    step = int(match.group(1))
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert f"checkpoint  {checkpoint}" in note and f"Exit status {status} (128 + {name})" in note
    assert torch.load(checkpoint, weights_only=False)["global_step"] == step
    assert "Traceback" not in (tmp_path / f"{name}.log").read_text()
    assert not (run_dir / "summary.json").exists()

    command = note.split("resume with ", 1)[1].splitlines()[0]
    assert f"ckpt_path={checkpoint}" in command and f"hydra.run.dir={run_dir}" in command
    resumed = subprocess.run(command, shell=True, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"steps        {STEPS - step} (resumed at step {step})" in resumed.stdout
    assert not (run_dir / "FAILED").exists()
    assert metric_steps(run_dir) == list(range(STEPS))  # both parts, each step once
    # the resumed run's end overwrote last.ckpt (not a last-v1.ckpt beside it, which would leave
    # last.ckpt at the interrupted step for the next resume)
    assert torch.load(checkpoint, weights_only=False)["global_step"] == STEPS
    assert not list(checkpoint.parent.glob("last-v*"))


def optimizer_state(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return {"global_step": checkpoint["global_step"], **checkpoint["optimizer_states"][0]}


@pytest.mark.slow
def test_a_bf16_sr_run_stopped_by_sigterm_keeps_its_rounding_state_through_the_resume(tmp_path):
    """bf16_sr keeps no master: its weights depend on every stochastic rounding, so the checkpoint a
    signal writes carries the rounding generator (seed, and a counter at the step it stopped after) and
    the BF16 moments, and the resumed run goes on from them, where it stopped in the epoch's data: it
    ends bit for bit as a run that was never stopped."""
    full_dir = tmp_path / "full"
    full_args = [f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=2"]
    full = start(
        [*full_args, *QUIET, "precision=bf16_sr", f"hydra.run.dir={full_dir}"], tmp_path, tmp_path / "full.log"
    )
    run_dir, note, code = interrupt(tmp_path, signal.SIGTERM, ("precision=bf16_sr",))
    assert code == 143, note
    step = int(re.search(r"at step (\d+)", note).group(1))
    stopped = optimizer_state(run_dir)
    assert stopped["global_step"] == step and stopped["master_kind"] == "stochastic"
    assert stopped["sr_generator"]["counter"] == step  # one draw of keys per step taken
    moments = [s for s in stopped["state"].values() if s["exp_avg"].dtype == torch.bfloat16]
    assert moments and all(int(s["step"]) == step for s in moments)
    command = note.split("resume with ", 1)[1].splitlines()[0]
    resumed = subprocess.run(command, shell=True, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    finished = optimizer_state(run_dir)
    assert finished["global_step"] == STEPS
    assert finished["sr_generator"] == {"seed": stopped["sr_generator"]["seed"], "counter": STEPS}
    assert all(int(s["step"]) == STEPS for s in finished["state"].values())
    assert full.wait(timeout=300) == 0, (tmp_path / "full.log").read_text()[-3000:]
    expected, got = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=False) for d in (full_dir, run_dir))
    assert not differences(expected["state_dict"], got["state_dict"])
    assert not differences(expected["optimizer_states"], got["optimizer_states"])


@pytest.mark.slow
def test_sighup_saves_a_checkpoint_and_leaves_a_note_like_sigterm(tmp_path):
    run_dir, note, code = interrupt(tmp_path, signal.SIGHUP)  # a closed terminal or ssh session
    assert code == 129, note + (tmp_path / "SIGHUP.log").read_text()[-3000:]
    match = re.search(r"Interrupted by SIGHUP at step (\d+): the run stopped after that step and saved", note)
    assert match, note
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=False)["global_step"] == int(match.group(1))
    assert "Exit status 129 (128 + SIGHUP)" in note and "resume with " in note
    assert "Traceback" not in (tmp_path / "SIGHUP.log").read_text()


@pytest.mark.slow
def test_sigterm_in_the_last_step_lets_the_run_finish_and_says_so(tmp_path):
    run_dir, log = tmp_path / "late", tmp_path / "late.log"
    args = ["recipe=underflow_demo", "trainer.max_steps=5", "trainer.limit_val_batches=1", *QUIET]
    proc = start([*args, *throttle(5, 4.0), f"hydra.run.dir={run_dir}"], tmp_path, log)  # sleeps after step 5
    try:
        wait_until(lambda: logged_steps(log), proc)
        time.sleep(2.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM received after the last step began: the run finished it (step 5)" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and any("SIGTERM received" in n for n in summary["notes"])
    assert not (run_dir / "FAILED").exists()
