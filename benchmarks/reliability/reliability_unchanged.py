"""Bad input changes nothing: a finished run's directory, byte for byte, after runs that a check refuses
(overwrite=true with a bad value, over another run's checkpoint, with launcher variables left in the
environment), a sweep that overwrites beside a finished run, a job whose directory another run took
while the sweep ran, and a short run whose every step was skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from reliability_harness import TINY, child_env, run, start, training_started, wait_for

__all__ = [
    "late_sigterm",
    "leftover_rank",
    "overwrite_bad_value",
    "overwrite_foreign",
    "short_all_skipped",
    "sweep_overwrite",
    "taken_job",
]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) with its bytes, the lock file aside."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _finished(work: Path, name: str, *extra: str) -> Path:
    directory = work / name
    done = run([*TINY, *extra, f"hydra.run.dir={directory}"], work)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return directory


def _refused(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout


def overwrite_bad_value(work: Path) -> dict[str, Any]:
    done = _finished(work, "done")
    before = snapshot(done)
    bad = {
        "recipe.lr=-1": ["recipe.lr=-1"],
        "recipe.lr=nan": ["recipe.lr=nan"],
        "a missing ckpt_path": ["ckpt_path=nowhere.ckpt", "trainer.max_steps=5"],
        "trainer.devices=64": ["trainer.devices=64"],
    }
    results = {what: run([*TINY, "overwrite=true", *args, f"hydra.run.dir={done}"], work) for what, args in bad.items()}
    refused = all(_refused(r) and "Invalid configuration" in r.stderr for r in results.values())
    same = snapshot(done) == before
    return {
        "fault": "overwrite=true with a bad value",
        "lost": not same,
        "resume_exact": None,
        "how": f"{', '.join(bad)}: each refused in one line (exit 1) before anything is deleted; the finished run's "
        "summary, checkpoints, logs, .hydra/ and train.log byte for byte as they were"
        + ("" if refused else " (**not every one refused cleanly**)")
        + " (before: only FAILED and train.log were left)",
    }


def overwrite_foreign(work: Path) -> dict[str, Any]:
    mine, other = _finished(work, "mine"), _finished(work, "other", "seed=1")
    shutil.copy(other / "checkpoints" / "last.ckpt", mine / "checkpoints" / "from_other.ckpt")
    users = _finished(work, "users", "seed=2")
    (users / "checkpoints" / "pretrained.ckpt").write_text("the user's\n")
    before = {d: snapshot(d) for d in (mine, users)}
    results = [run([*TINY, "overwrite=true", f"hydra.run.dir={d}"], work) for d in (mine, users)]
    named = "from_other.ckpt" in results[0].stderr and "pretrained.ckpt" in results[1].stderr
    same = all(snapshot(d) == before[d] for d in (mine, users))
    return {
        "fault": "overwrite=true over another run's or a user's checkpoint",
        "lost": not same,
        "resume_exact": None,
        "how": "refused in one line naming checkpoints/from_other.ckpt (another run id) and checkpoints/pretrained.ckpt"
        + ("" if named and all(map(_refused, results)) else " (**not named**)")
        + "; nothing deleted (before: every *.ckpt went)",
    }


def sweep_overwrite(work: Path) -> dict[str, Any]:
    results = work / "results"
    baseline = _finished(work, "results/baseline")
    stale = results / "7"
    stale.mkdir()
    (stale / "FAILED").write_text("RuntimeError: an old sweep's job\n")
    before = snapshot(baseline)
    sweep = run(["-m", *TINY, f"hydra.sweep.dir={results}", "overwrite=true", "seed=1,2"], work)
    jobs_ok = all((results / j / "summary.json").is_file() for j in ("0", "1"))
    same = snapshot(baseline) == before and (stale / "FAILED").is_file()
    return {
        "fault": "sweep with overwrite=true beside a finished run and a stale FAILED",
        "lost": not same,
        "resume_exact": None,
        "how": f"exit {sweep.returncode}; jobs 0 and 1 trained"
        + ("" if jobs_ok else " (**not both**)")
        + "; results/baseline byte for byte as it was, and the stale FAILED of a job this sweep did not run does not "
        "fail it (before: baseline's checkpoints, logs and summary deleted; a stale FAILED failed the sweep)",
    }


def taken_job(work: Path) -> dict[str, Any]:
    """While job 0 of a sweep sets up, another run takes job 1's directory (a ``HoldDirectory`` callback)."""
    results, pid_file = work / "sweep", work / "holder.pid"
    args = [
        "-m",
        *TINY,
        f"hydra.sweep.dir={results}",
        "seed=1,2",
        "+callbacks.hold._target_=reliability_harness.HoldDirectory",
        f"+callbacks.hold.directory={results / '1'}",
        f"+callbacks.hold.pid_file={pid_file}",
    ]
    try:
        sweep = run(args, work)
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            time.sleep(0.2)
    held = results / "1"
    same = (held / ".hydra" / "config.yaml").read_text() == "precision: mine\n" and (
        held / "train.log"
    ).read_text() == "mine\n"
    return {
        "fault": "a job's directory taken by another run mid-sweep",
        "lost": not same,
        "resume_exact": None,
        "how": f"exit {sweep.returncode}; job 1 refused in one line, and the other run's .hydra/config.yaml and "
        "train.log untouched (before: Hydra rewrote .hydra/config.yaml before the job was refused)",
    }


def leftover_rank(work: Path) -> dict[str, Any]:
    done = _finished(work, "finished")
    before = snapshot(done)
    ranks = run([*TINY, "seed=5", f"hydra.run.dir={done}"], work, env=child_env(WORLD_SIZE="2", RANK="1"))
    nodes = run(
        [*TINY, "trainer.num_nodes=2", "strategy=ddp", f"hydra.run.dir={work / 'nodes'}"],
        work,
        timeout=120,
        env=child_env(WORLD_SIZE="1"),
    )
    lines = _refused(ranks) and "RANK=1" in ranks.stderr and _refused(nodes) and "WORLD_SIZE=1" in nodes.stderr
    same = snapshot(done) == before
    return {
        "fault": "launcher variables left in the environment",
        "lost": not same,
        "resume_exact": None,
        "how": "WORLD_SIZE=2 RANK=1 into a finished run's directory: refused in one line, the directory byte for byte "
        "as it was (before: lock and reuse check skipped, summary.json and .hydra/ overwritten, exit 0); WORLD_SIZE=1 "
        "with trainer.num_nodes=2: refused before launching (before: a hang)"
        + ("" if lines else " (**not both refused cleanly**)"),
    }


def short_all_skipped(work: Path) -> dict[str, Any]:
    out = work / "skipped"
    proc = run([*TINY, "trainer.max_steps=9", "+fault.inject_inf_from=0", f"hydra.run.dir={out}"], work)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    ok = proc.returncode == 1 and summary.get("status") == "failed" and "9 of its 9 steps" in proc.stderr
    return {
        "fault": "every step of a 9-step run skipped",
        "lost": not ok,
        "resume_exact": None,
        "how": "exit 1, summary.json status 'failed', FAILED: the last 9 of its 9 steps were all skipped (before: "
        "exit 0, status ok)",
    }


def late_sigterm(work: Path) -> dict[str, Any]:
    """SIGTERM while the last step's callbacks run (a ``Throttle`` holds it there for 4 s)."""
    out, log = work / "late", work / "late.log"
    args = [*TINY, "trainer.max_steps=5", "trainer.limit_val_batches=1"]
    throttle = [
        "+callbacks.throttle._target_=reliability_harness.Throttle",
        "+callbacks.throttle.after_step=5",
        "+callbacks.throttle.seconds=4",
    ]
    proc = start([*args, *throttle, f"hydra.run.dir={out}"], work, log)
    wait_for(lambda: training_started(log), proc)
    time.sleep(2.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    said = "SIGTERM received after the last step began" in log.read_text()
    ok = (
        proc.returncode == 0
        and summary.get("status") == "ok"
        and said
        and (out / "checkpoints" / "last.ckpt").is_file()
    )
    return {
        "fault": "SIGTERM in the last step",
        "lost": not ok,
        "resume_exact": None,
        "how": f"exit {proc.returncode}; the run finished its last step, validated and wrote its outputs, and says "
        "so on stderr and in summary.json's notes (before: the signal went unmentioned)",
    }
