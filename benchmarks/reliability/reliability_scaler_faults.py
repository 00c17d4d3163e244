"""Faults a loss scaler must absorb or stop on: an overflow, a NaN loss or a NaN input before and after a
resume point; a scale that collapses; a run that diverges; every step skipped to the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from reliability_harness import QUIET, K, finite, load, resumable_args, run, same_state, train_steps

__all__ = ["collapse", "divergence", "fault_in_run", "stalled"]


def fault_in_run(work: Path, name: str, fault: list[str], expect_skips: int) -> dict[str, Any]:
    """A fault a loss scaler must absorb, before and after the resume point; resume at the epoch end."""
    full, resumed = work / "full", work / "resumed"
    args = [*resumable_args(2 * K), *fault, "trainer.log_every_n_steps=1", "callbacks.model_checkpoint.save_top_k=-1"]
    a = run([*args, f"hydra.run.dir={full}"], work)
    first = full / "checkpoints" / f"epoch0-step{K}.ckpt"
    b = run([*args, f"ckpt_path={first}", f"hydra.run.dir={resumed}"], work)
    ok = a.returncode == 0 and b.returncode == 0
    summary = json.loads((full / "summary.json").read_text()) if ok else {}
    lost = (
        not ok
        or summary.get("skipped_steps") != expect_skips
        or train_steps(full) != list(range(2 * K))
        or not finite(full / "checkpoints" / "last.ckpt")
    )
    exact = ok and same_state(full / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt")
    return {
        "fault": name,
        "lost": lost,
        "resume_exact": exact,
        "how": f"{expect_skips} faulty steps (one before, one after the resume point) skipped and counted, all "
        f"{2 * K} steps logged; resumed from the step-{K} checkpoint into a new directory",
    }


def collapse(work: Path) -> dict[str, Any]:
    run_dir = work / "collapse"
    args = [
        "+fault.inject_inf_at=[1]",
        "+fault.inject_inf_from=12",
        "scaler.init_scale=4",
        "scaler.min_scale=1",
        "trainer.max_steps=30",
        "callbacks.recovery_checkpoint.every_n_steps=5",
        "callbacks.recovery_checkpoint.healthy_steps=3",
        "trainer.limit_val_batches=1",
        *QUIET,
    ]
    a = run([*args, f"hydra.run.dir={run_dir}"], work)
    good = run_dir / "checkpoints" / "last-good.ckpt"
    saved = load(good) if good.is_file() else {}
    healthy = saved.get("global_step") == 10 and saved["amp_plugin"]["scaler"]["consecutive_skips"] == 0
    b = run(
        [
            "scaler.init_scale=4",
            f"ckpt_path={good}",
            "trainer.max_steps=14",
            "trainer.limit_val_batches=1",
            *QUIET,
            f"hydra.run.dir={work / 'collapse_resumed'}",
        ],
        work,
    )
    restarted = b.returncode == 0 and "restarts at scaler.init_scale=4 (it was 2 there)" in b.stdout
    return {
        "fault": "collapse",
        "lost": not (a.returncode == 1 and healthy and restarted),
        "resume_exact": None,
        "how": "exit 1 with the step and what to try; last-good.ckpt is the healthy step-10 state, not the "
        "collapsed step-13 one; resuming from it restarts the scale at init_scale (on purpose, not exact)",
    }


def divergence(work: Path) -> dict[str, Any]:
    """SGD with a learning rate that makes the weights grow until FP16 overflows at every scale."""
    run_dir = work / "diverge"
    args = [
        "recipe.optimizer=sgd",
        "trainer.max_steps=200",
        "callbacks.recovery_checkpoint.every_n_steps=5",
        "callbacks.recovery_checkpoint.healthy_steps=3",
        "trainer.limit_val_batches=1",
        *QUIET,
    ]
    a = run([*args, "recipe.lr=30", f"hydra.run.dir={run_dir}"], work)
    good = run_dir / "checkpoints" / "last-good.ckpt"
    saved = load(good) if good.is_file() else {}
    collapsed = re.search(r"\(step (\d+), (\d+) steps skipped in a row\)", a.stderr)
    healthy = (
        bool(saved)
        and finite(good)
        and saved["amp_plugin"]["scaler"]["consecutive_skips"] == 0
        and collapsed is not None
        and saved["global_step"] <= int(collapsed.group(1)) - int(collapsed.group(2))
    )
    b = (
        run(
            [
                *args,
                "recipe.lr=0.003",
                f"ckpt_path={good}",
                "trainer.max_steps=60",
                f"hydra.run.dir={work / 'diverge_resumed'}",
            ],
            work,
        )
        if healthy
        else None
    )
    resumed = b is not None and b.returncode == 0 and "recipe.lr=0.003 (the checkpoint's run had 30)" in b.stdout
    where = (
        (
            f"collapsed at step {collapsed.group(1)} after {collapsed.group(2)} skips in a row; last-good.ckpt is "
            f"step {saved.get('global_step')}, before the skips, finite"
        )
        if collapsed and saved
        else "no collapse"
    )
    return {
        "fault": "divergence (SGD, lr=30)",
        "lost": not (a.returncode == 1 and healthy and resumed),
        "resume_exact": None,
        "how": f"{where}; resumed from it with recipe.lr=0.003 (applied and logged) and the scale restarted",
    }


def stalled(work: Path) -> dict[str, Any]:
    """Every step from step 1 on overflows and ``on_min_scale=skip`` keeps skipping to the last step."""
    run_dir = work / "stalled"
    a = run(
        [
            "+fault.inject_inf_from=1",
            "scaler.on_min_scale=skip",
            "scaler.init_scale=4",
            "scaler.min_scale=1",
            "trainer.max_steps=12",
            "trainer.limit_val_batches=1",
            *QUIET,
            f"hydra.run.dir={run_dir}",
        ],
        work,
    )
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    failed = (
        a.returncode == 1
        and "Traceback" not in a.stderr
        and summary.get("status") == "failed"
        and "were all skipped" in (run_dir / "FAILED").read_text()
    )
    return {
        "fault": "every step skipped from step 1 on",
        "lost": not failed,
        "resume_exact": None,
        "how": f"exit {a.returncode}, summary.json status {summary.get('status')!r}, FAILED: the last 11 of its 12 "
        "steps were all skipped (before: exit 0, status ok)",
    }
