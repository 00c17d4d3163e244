"""Faults in the directories a run writes to: runs started together, a directory in use by a live run
(one run or a sweep), a run directory deleted mid-run, and the fused-kernel build cache left locked by a
killed build.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reliability_harness import QUIET, ROOT, TINY, child_env, run, start, training_started, wait_for

__all__ = ["concurrent", "deleted", "live_sweep", "stale_build_lock"]


def concurrent(work: Path) -> dict[str, Any]:
    folder = work / "together"
    folder.mkdir()
    logs = [folder / f"{seed}.log" for seed in (1, 2)]
    procs = [start([*TINY, f"seed={seed}"], folder, log) for seed, log in zip((1, 2), logs)]
    for proc in procs:
        proc.wait(timeout=300)
    dirs = sorted(p.parent for p in (folder / "outputs").rglob("summary.json"))
    seeds = {json.loads((d / "summary.json").read_text())["seed"] for d in dirs}
    busy = work / "busy"
    log = work / "busy.log"
    first = start(
        [
            "trainer.max_steps=300",
            *QUIET,
            "+callbacks.throttle._target_=reliability_harness.Throttle",
            "+callbacks.throttle.after_step=0",
            "+callbacks.throttle.seconds=0.2",
            f"hydra.run.dir={busy}",
        ],
        work,
        log,
    )
    wait_for(lambda: training_started(log), first)
    second = run([*TINY, f"hydra.run.dir={busy}"], work)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    refused = second.returncode == 1 and "is in use by a run" in second.stderr
    ok = all(p.returncode == 0 for p in procs) and len(dirs) == 2 and seeds == {1, 2} and refused
    return {
        "fault": "concurrent runs",
        "lost": not ok,
        "resume_exact": None,
        "how": "two runs started together get two directories, each complete; a run into a directory in use is "
        "refused with one line",
    }


def _hold(directory: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from amp_plugin.app import rundir; rundir.claim(sys.argv[1]); "
        "print('held', flush=True); time.sleep(300)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def live_sweep(work: Path) -> dict[str, Any]:
    """A sweep (with and without overwrite=true) whose job directory ``0`` is a live run's."""
    sweep = work / "sweep"
    live = sweep / "0"
    (live / ".hydra").mkdir(parents=True)
    (live / ".hydra" / "config.yaml").write_text("precision: fp16\n")
    for name in ("logs/metrics.csv", "checkpoints/last.ckpt"):
        (live / name).parent.mkdir(exist_ok=True)
        (live / name).write_text("live\n")
    (live / ".amp_run").write_text('{"run_id": "live"}\n')
    holder = _hold(live)
    try:
        results = [
            run(["-m", *TINY, "seed=1,2", f"hydra.sweep.dir={sweep}", flag], work)
            for flag in ("overwrite=true", "overwrite=false")
        ]
    finally:
        holder.kill()
        holder.wait()
    intact = all((live / n).read_text() == "live\n" for n in ("logs/metrics.csv", "checkpoints/last.ckpt"))
    intact = intact and (live / ".hydra" / "config.yaml").read_text() == "precision: fp16\n"
    refused = all(r.returncode == 1 and "still writing to it" in r.stderr for r in results)
    return {
        "fault": "sweep into a live run's directory",
        "lost": not (intact and refused),
        "resume_exact": None,
        "how": "refused before Hydra writes a job (with and without overwrite=true), exit 1; the live run's logs/, "
        "checkpoints/ and .hydra/ untouched",
    }


def deleted(work: Path) -> dict[str, Any]:
    run_dir, log = work / "doomed", work / "doomed.log"
    proc = start(
        [
            "trainer.max_steps=300",
            *QUIET,
            "+callbacks.throttle._target_=reliability_harness.Throttle",
            "+callbacks.throttle.after_step=0",
            "+callbacks.throttle.seconds=0.2",
            f"hydra.run.dir={run_dir}",
        ],
        work,
        log,
    )
    wait_for(lambda: training_started(log), proc)
    time.sleep(1.0)
    shutil.rmtree(run_dir)
    proc.wait(timeout=300)
    output = log.read_text()
    lines = [line for line in output.splitlines() if "was deleted while the run was writing to it" in line]
    ok = proc.returncode == 1 and "Traceback" not in output and len(lines) == 1 and not run_dir.exists()
    return {
        "fault": "run directory deleted mid-run",
        "lost": not ok,
        "resume_exact": None,
        "how": f"exit {proc.returncode} at the next step with one line naming hydra.run.dir; the directory is not "
        "created again",
    }


def stale_build_lock(work: Path) -> dict[str, Any]:
    """A copy of this machine's fused-kernel build with torch's lock file left in it, as a build killed
    half-way leaves it: a run must go on (torch itself waits for that file to go away, forever)."""
    from torch.utils.cpp_extension import _get_build_directory

    from amp_plugin import fused

    name = fused._flags()[0]
    entry = Path(_get_build_directory(name, False))
    if not (entry / f"{name}.so").is_file():
        return {"fault": "stale fused-kernel build lock", "lost": None, "resume_exact": None, "how": "not built here"}
    cache = work / "torch_extensions"
    shutil.copytree(entry, cache / entry.name, symlinks=True)
    (cache / entry.name / "lock").write_text("")
    a = run([*TINY, f"hydra.run.dir={work / 'run'}"], work, timeout=600, env=child_env(TORCH_EXTENSIONS_DIR=str(cache)))
    named = f"removed {cache / entry.name / 'lock'}" in a.stderr
    return {
        "fault": "stale fused-kernel build lock",
        "lost": not (a.returncode == 0 and named),
        "resume_exact": None,
        "how": f"exit {a.returncode}; the run names and removes the lock left by the killed build and loads the "
        "cached kernels (before: every run waited forever)",
    }
