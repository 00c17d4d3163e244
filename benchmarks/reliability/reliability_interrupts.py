"""A run stopped from outside: SIGKILL, SIGTERM and SIGINT mid-run, a full disk while saving, SIGTERM
before the first step; where the protocol resumes, whether the resumed run ends where an uninterrupted
run ends, bit for bit.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from reliability_harness import (
    TINY,
    K,
    child_env,
    load,
    resumable_args,
    run,
    same_logs,
    same_state,
    start,
    train_steps,
    training_started,
    wait_for,
)

__all__ = ["disk_full", "early_sigterm", "interrupt", "sigkill"]


def sigkill(work: Path) -> dict[str, Any]:
    full, victim = work / "kill_full", work / "kill_victim"
    args = [*resumable_args(3 * K), f"+fault.inject_inf_at=[5,{K + 7}]"]
    a = run([*args, f"hydra.run.dir={full}"], work)
    proc = start(
        [
            *args,
            "+callbacks.throttle._target_=reliability_harness.Throttle",
            f"+callbacks.throttle.after_step={K}",
            "+callbacks.throttle.seconds=0.5",
            f"hydra.run.dir={victim}",
        ],
        work,
        work / "kill_victim.log",
    )
    last = victim / "checkpoints" / "last.ckpt"
    wait_for(last.is_file, proc)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    b = run([*args, f"ckpt_path={last}", f"hydra.run.dir={victim}"], work)
    ok = a.returncode == 0 and b.returncode == 0
    return {
        "fault": "SIGKILL",
        "lost": not (ok and same_logs(full, victim)),
        "resume_exact": ok and same_state(full / "checkpoints" / "last.ckpt", last),
        "how": f"killed after its step-{K} checkpoint; resumed in place: checkpoint, metrics.csv, "
        "scale_events.csv and training_curves.csv equal the uninterrupted run's",
    }


def interrupt(work: Path, signum: int) -> dict[str, Any]:
    name = signal.Signals(signum).name
    full, victim = work / f"{name}_full", work / f"{name}_victim"
    args = [*resumable_args(3 * K), "trainer.log_every_n_steps=1"]
    a = run([*args, f"hydra.run.dir={full}"], work)
    log = work / f"{name}.log"
    proc = start(
        [
            *args,
            "+callbacks.throttle._target_=reliability_harness.Throttle",
            "+callbacks.throttle.after_step=2",
            "+callbacks.throttle.seconds=0.25",
            f"hydra.run.dir={victim}",
        ],
        work,
        log,
    )
    wait_for(lambda: training_started(log), proc)
    time.sleep(2.0)
    proc.send_signal(signum)
    proc.wait(timeout=120)
    note = (victim / "FAILED").read_text() if (victim / "FAILED").is_file() else ""
    step = re.search(r"at step (\d+)", note)
    command = note.split("resume with ", 1)[1].splitlines()[0] if "resume with " in note else None
    b = (
        subprocess.run(command, shell=True, env=child_env(), capture_output=True, text=True, timeout=600)
        if command
        else None
    )
    ok = (
        a.returncode == 0
        and proc.returncode == 128 + signum
        and step is not None
        and b is not None
        and b.returncode == 0
    )
    lost = not ok or train_steps(victim) != list(range(3 * K))
    exact = ok and same_state(full / "checkpoints" / "last.ckpt", victim / "checkpoints" / "last.ckpt")
    where = f"at step {step.group(1)}" if step else "(no step recorded)"
    return {
        "fault": name,
        "lost": lost,
        "resume_exact": exact,
        "how": f"exit {proc.returncode}, checkpoint {where}; the resume command from FAILED finished the run in "
        "place with every step logged once"
        + ("" if exact else "; mid-epoch, so the epoch's data order restarts and the result differs"),
    }


def disk_full(work: Path) -> dict[str, Any]:
    full, victim = work / "disk_full_ref", work / "disk_full"
    args = resumable_args(3 * K)
    a = run([*args, f"hydra.run.dir={full}"], work)
    b = run(
        [
            *args,
            "+callbacks.fill._target_=reliability_harness.FillDisk",
            f"+callbacks.fill.at_step={K + 1}",
            "+callbacks.fill.limit=65536",
            f"hydra.run.dir={victim}",
        ],
        work,
    )
    last = victim / "checkpoints" / "last.ckpt"
    clear = b.returncode == 1 and "Could not write the checkpoint" in b.stderr and "Traceback" not in b.stderr
    intact = last.is_file() and load(last)["global_step"] == K
    c = run([*args, f"ckpt_path={last}", f"hydra.run.dir={victim}"], work) if intact else None
    ok = a.returncode == 0 and clear and c is not None and c.returncode == 0
    return {
        "fault": "disk full while saving",
        "lost": not ok,
        "resume_exact": ok and same_state(full / "checkpoints" / "last.ckpt", last),
        "how": "RLIMIT_FSIZE from step 24: the step-46 save fails with EFBIG; exit 1 naming the file and the fix; "
        f"the step-{K} last.ckpt intact; resumed in place",
    }


def early_sigterm(work: Path) -> dict[str, Any]:
    run_dir, log, marker = work / "early", work / "early.log", work / "marker"
    proc = start(
        [
            *TINY,
            "+callbacks.slow._target_=reliability_harness.SlowSetup",
            f"+callbacks.slow.marker={marker}",
            "+callbacks.slow.seconds=120",
            f"hydra.run.dir={run_dir}",
        ],
        work,
        log,
    )
    wait_for(marker.is_file, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    note = (run_dir / "FAILED").read_text() if (run_dir / "FAILED").is_file() else ""
    ok = proc.returncode == 143 and note.startswith("Interrupted by SIGTERM before training started")
    return {
        "fault": "SIGTERM before the first step",
        "lost": not ok,
        "resume_exact": None,
        "how": f"exit {proc.returncode}, FAILED: {note.splitlines()[0] if note else '(none)'}",
    }
