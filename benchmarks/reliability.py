"""Reliability numbers for RELIABILITY.md: bad input tried through the CLI, faults injected into real runs.

    python benchmarks/reliability.py [--work DIR] [--write RELIABILITY.md]

Everything runs ``train.py`` (or ``amp-compare``) as a user or a scheduler would: in a
subprocess, with signals, concurrent processes, a full disk and damaged files.

1. Bad input: each command line (or environment, or file) must exit non-zero with a clear
   message: no traceback, the key, variable or path named, at most a few lines, and no
   ``summary.json`` left as if the run had worked.
2. Faults: for each, whether anything was lost (a checkpoint, a logged step, a run's files) and,
   where the protocol resumes, whether the resumed run ends bit for bit where an uninterrupted
   run ends (weights, FP32 masters, optimizer state, loss scale, step) and its logs read the same.

Writes ``benchmarks/results/reliability.json`` and prints the Markdown table; with ``--write``,
replaces the table between the ``reliability-table`` markers of that file.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from amp_plugin.lightning import pl

ROOT = Path(__file__).resolve().parents[1]
K = 23  # batches per epoch of the default digits recipe: checkpoints at epoch ends resume exactly
QUIET = ["trainer.enable_progress_bar=false", "plot=false"]
TINY = ["recipe=underflow_demo", "trainer.max_steps=3", *QUIET]
MARK = "<!-- reliability-table -->"


# ---------------------------------------------------------------------------------- processes
class Throttle(pl.Callback):
    """Sleep after every step from ``after_step`` on: a window in which to signal the run.

    The training process builds it from ``+callbacks.throttle._target_=reliability.Throttle``.
    """

    def __init__(self, after_step: int, seconds: float) -> None:
        self.after_step, self.seconds = after_step, seconds

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.after_step:
            time.sleep(self.seconds)


class FillDisk(pl.Callback):
    """From ``at_step`` on, no file may grow past ``limit`` bytes (``RLIMIT_FSIZE``, ``SIGXFSZ``
    ignored): the next larger write fails with EFBIG, as on a full disk with ENOSPC."""

    def __init__(self, at_step: int, limit: int) -> None:
        self.at_step, self.limit = at_step, limit

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), str(ROOT), env.get("PYTHONPATH")]))
    return env | extra


def train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args]


def run(
    args: list[str],
    cwd: Path,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command or train_cmd(args),
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(train_cmd(args), cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended (status {proc.returncode}) or timed out before it was ready")
        time.sleep(0.05)


def training_started(log: Path) -> bool:
    return log.is_file() and "amp_plugin: precision=" in log.read_text(errors="replace")


# ---------------------------------------------------------------------------------- comparisons
def load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    import torch

    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{path} (keys)"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def same_state(a: Path, b: Path) -> bool:
    x, y = load(a), load(b)
    return all(
        not differences(x[key], y[key])
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "amp_plugin", "global_step")
    )


def train_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


def same_logs(a: Path, b: Path) -> bool:
    return all(
        (a / n).read_text() == (b / n).read_text()
        for n in ("logs/metrics.csv", "logs/scale_events.csv", "training_curves.csv")
    )


def finite(path: Path) -> bool:
    import torch

    return all(torch.isfinite(t).all() for t in load(path)["state_dict"].values() if t.is_floating_point())


# ---------------------------------------------------------------------------------- 1. bad input
# (what, command-line arguments, a string the message must name). Paths are relative to the work dir.
BAD_ARGS = [
    ("unknown precision", ["precision=half"], "precision"),
    ("unknown scaler", ["scaler=magic"], "scaler"),
    ("unknown recipe", ["recipe=imagenet"], "recipe"),
    ("growth_factor <= 1", ["scaler.growth_factor=0.5"], "scaler.growth_factor"),
    ("backoff_factor >= 1", ["scaler.backoff_factor=2"], "scaler.backoff_factor"),
    ("growth_interval 0", ["scaler.growth_interval=0"], "scaler.growth_interval"),
    ("min_scale 0", ["scaler.min_scale=0"], "scaler.min_scale"),
    ("max_scale inf", ["scaler.max_scale=inf"], "scaler.max_scale"),
    ("init_scale outside limits", ["scaler.init_scale=0.5"], "scaler.init_scale"),
    ("hysteresis 0", ["scaler.hysteresis=0"], "scaler.hysteresis"),
    ("on_min_scale typo", ["scaler.on_min_scale=stop"], "scaler.on_min_scale"),
    ("scaler key without a scaler", ["precision=bf16", "scaler.init_scale=8"], "scaler.init_scale"),
    ("fp32 with a scaler", ["precision=fp32", "scaler=dynamic"], "precision='fp32'"),
    ("contradictory preset", ["precision=fp16_pure", "precision.master_weights=true"], "precision.master_weights"),
    ("trainer.precision", ["+trainer.precision=16-mixed"], "trainer.precision"),
    ("max_steps not an int", ["trainer.max_steps=1.5"], "trainer.max_steps"),
    ("accumulate_grad_batches 0", ["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches"),
    (
        "val_check_interval > epoch",
        ["trainer.val_check_interval=1000", "trainer.max_steps=5"],
        "trainer.val_check_interval",
    ),
    ("negative seed", ["seed=-1"], "seed"),
    ("num_threads 0", ["num_threads=0"], "num_threads"),
    ("recipe.lr=-1", ["recipe.lr=-1"], "recipe.lr"),
    ("recipe.lr=nan", ["recipe.lr=nan"], "recipe.lr"),
    ("recipe.batch_size=0", ["recipe.batch_size=0"], "recipe.batch_size"),
    ("recipe key typo", ["+recipe.lrr=0.1"], "recipe.lrr"),
    ("fault step negative", ["+fault.inject_inf_at=[-1]"], "fault.inject_inf_at"),
    ("fault on a missing rank", ["+fault.rank=1", "+fault.inject_inf_at=[2]"], "fault.rank"),
    ("fault on a missing param", ["+fault.param=nope", "+fault.inject_inf_at=[2]"], "fault.param"),
    ("NaN input into token ids", ["recipe=char_gpt", "+fault.nan_input_at=[1]"], "fault.nan_input_at"),
    ("ckpt_path missing", ["ckpt_path=nowhere.ckpt"], "ckpt_path"),
    ("ckpt_path a directory", ["ckpt_path=good"], "ckpt_path"),
    ("ckpt_path truncated", ["ckpt_path=truncated.ckpt"], "ckpt_path"),
    ("ckpt_path not a checkpoint", ["ckpt_path=plain.ckpt"], "ckpt_path"),
    (
        "ckpt_path already at max_steps",
        ["ckpt_path=good/checkpoints/last.ckpt", "trainer.max_steps=3"],
        "trainer.max_steps",
    ),
    (
        "checkpoint of another recipe",
        ["recipe=underflow_demo", "ckpt_path=good/checkpoints/last.ckpt", "trainer.max_steps=9"],
        "ckpt_path",
    ),
    (
        "checkpoint of another model shape",
        ["recipe.hidden_sizes=[64,64]", "ckpt_path=good/checkpoints/last.ckpt", "trainer.max_steps=9"],
        "ckpt_path",
    ),
    (
        "another optimizer on resume",
        ["recipe.optimizer=sgd", "ckpt_path=good/checkpoints/last.ckpt", "trainer.max_steps=9"],
        "recipe.optimizer",
    ),
    ("a finished run's directory", ["hydra.run.dir=good", "trainer.max_steps=3"], "hydra.run.dir"),
    ("val_check_interval 0", ["trainer.val_check_interval=0"], "trainer.val_check_interval"),
    ("gradient_clip_val nan", ["trainer.gradient_clip_val=nan"], "trainer.gradient_clip_val"),
    ("limit_train_batches 0", ["trainer.limit_train_batches=0"], "trainer.limit_train_batches"),
    ("max_epochs 0", ["trainer.max_steps=-1", "trainer.max_epochs=0"], "trainer.max_epochs"),
    ("num_nodes 2 without a cluster", ["trainer.num_nodes=2", "strategy=ddp"], "trainer.num_nodes"),
    ("checkpoint with a NaN loss scale", ["ckpt_path=nan_scale.ckpt", "trainer.max_steps=9"], "ckpt_path"),
    ("checkpoint with 64 flipped bytes", ["ckpt_path=flipped.ckpt", "trainer.max_steps=9"], "ckpt_path"),
    (
        "another run's checkpoint, resumed in place",
        ["ckpt_path=good/checkpoints/other.ckpt", "hydra.run.dir=good", "trainer.max_steps=9"],
        "ckpt_path",
    ),
    ("overwrite=true over a user's files", ["overwrite=true", "hydra.run.dir=userfiles"], "overwrite=true"),
    ("empty hydra.run.dir", ["hydra.run.dir="], "hydra.run.dir"),
]


def _prepare_bad_inputs(work: Path) -> None:
    import torch

    good = run(["trainer.max_steps=4", "trainer.limit_val_batches=1", *QUIET, "hydra.run.dir=good"], work)
    if good.returncode != 0:
        raise RuntimeError(good.stderr[-2000:])
    other = run(["trainer.max_steps=4", "seed=1", *QUIET, "hydra.run.dir=other"], work)
    if other.returncode != 0:
        raise RuntimeError(other.stderr[-2000:])
    last = work / "good" / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    (work / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    torch.save({"weights": torch.zeros(3)}, work / "plain.ckpt")
    flip_tensor_bytes(last, work / "flipped.ckpt")
    checkpoint = load(last)
    checkpoint["amp_plugin"]["scaler"]["scale"] = float("nan")
    checkpoint.pop("amp_plugin_checksum")
    torch.save(checkpoint, work / "nan_scale.ckpt")
    shutil.copy(work / "other" / "checkpoints" / "last.ckpt", work / "good" / "checkpoints" / "other.ckpt")
    for name in ("logs/notes.txt", "checkpoints/pretrained.pt"):
        (work / "userfiles" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "userfiles" / name).write_text("the user's\n")
    for name in ("logs_ro", "ckpt_ro"):
        (work / name / ("logs" if name == "logs_ro" else "checkpoints")).mkdir(parents=True)


def flip_tensor_bytes(src: Path, dst: Path, count: int = 64) -> None:
    """Flip ``count`` bytes in the middle of the checkpoint's largest tensor (``torch.load`` checks no tensor data)."""
    import zipfile

    with zipfile.ZipFile(src) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(src.read_bytes())
    header = entry.header_offset  # the local file header: 30 bytes, then the name and the extra field
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little")
    start += int.from_bytes(data[header + 28 : header + 30], "little") + max(0, entry.file_size // 2 - count // 2)
    for i in range(start, start + min(count, entry.file_size)):
        data[i] ^= 0xFF
    dst.write_bytes(bytes(data))


def _clear(output: str, proc_code: int, named: str, run_dir: Path | None) -> tuple[bool, str]:
    paragraphs = [p for p in output.strip().split("\n\n") if p.strip()]
    checks = {
        "exit status 0": proc_code != 0,
        "traceback": "Traceback" not in output,
        f"does not name {named}": named in output,
        "more than a few paragraphs": len(paragraphs) <= 4,
        "a summary.json as if it worked": run_dir is None
        or not (run_dir / "summary.json").exists()
        or named == "hydra.run.dir",
    }
    failed = [what for what, ok in checks.items() if not ok]
    return not failed, ", ".join(failed)


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


def bad_inputs(work: Path) -> list[dict[str, Any]]:
    work.mkdir(parents=True)
    _prepare_bad_inputs(work)
    results = []

    def record(what: str, proc: subprocess.CompletedProcess, named: str, run_dir: Path | None) -> None:
        ok, why = _clear(proc.stderr + proc.stdout, proc.returncode, named, run_dir)
        results.append(
            {
                "input": what,
                "exit": proc.returncode,
                "clear": ok,
                "problem": why,
                "message": next((line for line in proc.stderr.splitlines() if named in line), "")[:300],
            }
        )

    for i, (what, args, named) in enumerate(BAD_ARGS):
        run_dir = None if any(a.startswith("hydra.run.dir=") for a in args) else work / f"bad{i}"
        extra = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
        record(what, run([*args, *QUIET, *extra], work), named, run_dir)
    # The environment.
    record(
        "stray LOCAL_RANK=1",
        run([*TINY, f"hydra.run.dir={work / 'env1'}"], work, env=_env(LOCAL_RANK="1")),
        "LOCAL_RANK",
        work / "env1",
    )
    record(
        "AMP_PLUGIN_CONFIG_DIR pointing nowhere",
        run(
            TINY,
            work,
            env=_env(AMP_PLUGIN_CONFIG_DIR=str(work / "nowhere")),
            command=[sys.executable, "-m", "amp_plugin.app.cli", *TINY],
        ),
        "AMP_PLUGIN_CONFIG_DIR",
        None,
    )
    (work / "run_ro").mkdir()
    for name, sub, key in (
        ("logs_ro", "logs", "logger.save_dir"),
        ("ckpt_ro", "checkpoints", "callbacks.model_checkpoint.dirpath"),
        ("run_ro", "", "hydra.run.dir"),
    ):
        target = work / name / sub
        if not _read_only(target):
            continue
        try:
            what = f"read-only {sub}/" if sub else "read-only run directory"
            record(what, run([*TINY, f"hydra.run.dir={work / name}"], work), key, work / name)
        finally:
            _writable(target)
    # Damaged files for amp-compare.
    sweep = work / "compare_me"
    for job in ("0", "1", "2"):
        shutil.copytree(work / "good", sweep / job, ignore=shutil.ignore_patterns("checkpoints", ".lock"))
    (sweep / "1" / "summary.json").write_text((sweep / "1" / "summary.json").read_text()[:50])
    (sweep / "2" / "training_curves.csv").write_text("step,train_loss\n1,abc\n")
    compare = [sys.executable, "-m", "amp_plugin.app.compare"]
    record(
        "amp-compare: truncated summary.json",
        run([], work, command=[*compare, str(sweep / "1"), "--no-plot"]),
        "summary.json",
        None,
    )
    record(
        "amp-compare: bad training_curves.csv",
        run([], work, command=[*compare, str(sweep / "2"), "--no-plot"]),
        "training_curves.csv",
        None,
    )
    (work / "a_file").write_text("")
    record(
        "amp-compare: a file as --out",
        run([], work, command=[*compare, str(sweep / "0"), "--out", "a_file"]),
        "--out",
        None,
    )
    # A scheduled fault that never happens is a warning, not an error: checked apart.
    return results


# ---------------------------------------------------------------------------------- 2. faults
def _common(steps: int) -> list[str]:
    return [
        f"trainer.max_steps={steps}",
        f"callbacks.model_checkpoint.every_n_train_steps={K}",
        "scaler.growth_interval=10",
        *QUIET,
    ]


def fault_in_run(work: Path, name: str, fault: list[str], expect_skips: int) -> dict[str, Any]:
    """A fault a loss scaler must absorb, before and after the resume point; resume at the epoch end."""
    full, resumed = work / "full", work / "resumed"
    args = [*_common(2 * K), *fault, "trainer.log_every_n_steps=1", "callbacks.model_checkpoint.save_top_k=-1"]
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


def sigkill(work: Path) -> dict[str, Any]:
    full, victim = work / "kill_full", work / "kill_victim"
    args = [*_common(3 * K), f"+fault.inject_inf_at=[5,{K + 7}]"]
    a = run([*args, f"hydra.run.dir={full}"], work)
    proc = start(
        [
            *args,
            "+callbacks.throttle._target_=reliability.Throttle",
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
    args = [*_common(3 * K), "trainer.log_every_n_steps=1"]
    a = run([*args, f"hydra.run.dir={full}"], work)
    log = work / f"{name}.log"
    proc = start(
        [
            *args,
            "+callbacks.throttle._target_=reliability.Throttle",
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
        subprocess.run(command, shell=True, env=_env(), capture_output=True, text=True, timeout=600)
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
    args = _common(3 * K)
    a = run([*args, f"hydra.run.dir={full}"], work)
    b = run(
        [
            *args,
            "+callbacks.fill._target_=reliability.FillDisk",
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
            "+callbacks.throttle._target_=reliability.Throttle",
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


def _hold(directory: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from amp_plugin.app import rundir; rundir.claim(sys.argv[1]); "
        "print('held', flush=True); time.sleep(300)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True
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
            "+callbacks.throttle._target_=reliability.Throttle",
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


class SlowSetup(pl.Callback):
    """Hold the run between building the Trainer and its first step (``setup``), after writing ``marker``."""

    def __init__(self, marker: str, seconds: float) -> None:
        self.marker, self.seconds = marker, seconds

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        Path(self.marker).write_text("setting up\n")
        time.sleep(self.seconds)


def early_sigterm(work: Path) -> dict[str, Any]:
    run_dir, log, marker = work / "early", work / "early.log", work / "marker"
    proc = start(
        [
            *TINY,
            "+callbacks.slow._target_=reliability.SlowSetup",
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
    a = run([*TINY, f"hydra.run.dir={work / 'run'}"], work, timeout=600, env=_env(TORCH_EXTENSIONS_DIR=str(cache)))
    named = f"removed {cache / entry.name / 'lock'}" in a.stderr
    return {
        "fault": "stale fused-kernel build lock",
        "lost": not (a.returncode == 0 and named),
        "resume_exact": None,
        "how": f"exit {a.returncode}; the run names and removes the lock left by the killed build and loads the "
        "cached kernels (before: every run waited forever)",
    }


FAULTS = {
    "overflow": lambda w: fault_in_run(w, "overflow", [f"+fault.inject_inf_at=[5,{K + 7}]"], 2),
    "nan_loss": lambda w: fault_in_run(w, "NaN loss", [f"+fault.nan_loss_at=[4,{K + 4}]"], 2),
    "nan_input": lambda w: fault_in_run(w, "NaN input", [f"+fault.nan_input_at=[6,{K + 9}]"], 2),
    "collapse": collapse,
    "divergence": divergence,
    "sigkill": sigkill,
    "sigterm": lambda w: interrupt(w, signal.SIGTERM),
    "sigint": lambda w: interrupt(w, signal.SIGINT),
    "disk_full": disk_full,
    "concurrent": concurrent,
    "stalled": stalled,
    "live_sweep": live_sweep,
    "deleted": deleted,
    "early_sigterm": early_sigterm,
    "stale_build_lock": stale_build_lock,
}


# ---------------------------------------------------------------------------------- report
def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "**no**")


def table(inputs: list[dict[str, Any]], faults: list[dict[str, Any]]) -> str:
    clear = sum(r["clear"] for r in inputs)
    lines = [
        f"**Bad input: {len(inputs)} tried, {clear} with a clear message** (non-zero exit, no traceback, the key, "
        "variable or file named, a few lines at most, no summary.json).",
        "",
    ]
    unclear = [r for r in inputs if not r["clear"]]
    for r in unclear:
        lines.append(f"- not clear: {r['input']} ({r['problem']})")
    if unclear:
        lines.append("")
    lines += ["| fault injected | anything lost? | resume exact? | what happened |", "|---|---|---|---|"]
    for f in faults:
        lost = "n/a" if f["lost"] is None else "**yes**" if f["lost"] else "no"
        lines.append(f"| {f['fault']} | {lost} | {_yes(f['resume_exact'])} | {f['how']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="scratch directory (default: a fresh temporary one, deleted afterwards)")
    parser.add_argument("--write", help="a Markdown file whose table between the reliability-table markers to replace")
    parser.add_argument("--only", nargs="*", choices=["inputs", *FAULTS], help="run only these parts")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="amp_reliability_"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ["inputs", *FAULTS])
    started = time.perf_counter()
    inputs = bad_inputs(work / "inputs") if "inputs" in only else []
    faults = []
    for key, protocol in FAULTS.items():
        if key in only:
            folder = work / key
            folder.mkdir()
            faults.append(protocol(folder))
            print(f"{faults[-1]['fault']}: lost={faults[-1]['lost']} exact={faults[-1]['resume_exact']}", flush=True)
    out = ROOT / "benchmarks" / "results" / "reliability.json"
    if args.only and out.is_file():  # a partial run: keep the earlier results of the parts not run
        earlier = json.loads(out.read_text())
        if "inputs" not in only:
            inputs = earlier.get("bad_inputs", [])
        names = {f["fault"] for f in faults}
        faults = [f for f in earlier.get("faults", []) if f["fault"] not in names] + faults
    text = table(inputs, faults)
    print(text)
    out.write_text(
        json.dumps(
            {"bad_inputs": inputs, "faults": faults, "wall_time_s": round(time.perf_counter() - started)}, indent=2
        )
        + "\n"
    )
    if args.write:
        path = Path(args.write)
        before, rest = path.read_text().split(MARK, 1)
        _, after = rest.split(MARK, 1)
        path.write_text(f"{before}{MARK}\n{text}\n{MARK}{after}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
