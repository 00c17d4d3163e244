"""Bad input tried through the CLI: each command line, environment or file must exit non-zero with a
clear message (no traceback, the key, variable or path named, a few paragraphs at most) and leave no
``summary.json`` as if the run had worked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from reliability_harness import QUIET, TINY, child_env, load, run

__all__ = ["BAD_ARGS", "bad_inputs", "flip_tensor_bytes"]

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
    ("limit_val_batches 1e-9", ["trainer.limit_val_batches=1e-9"], "trainer.limit_val_batches"),
    ("limit_train_batches 1e-9", ["trainer.limit_train_batches=1e-9"], "trainer.limit_train_batches"),
    ("val_check_interval=true", ["trainer.val_check_interval=true"], "trainer.val_check_interval"),
    ("unquoted ~ in ckpt_path", ["ckpt_path=~/runs/last.ckpt"], "ckpt_path"),
    ("unquoted ( in hydra.run.dir", ["hydra.run.dir=runs/a(b)"], "hydra.run.dir"),
    ("FP8 margin -8", ["precision=fp8", "precision.fp8.margin=-8"], "margin"),
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
        run([*TINY, f"hydra.run.dir={work / 'env1'}"], work, env=child_env(LOCAL_RANK="1")),
        "LOCAL_RANK",
        work / "env1",
    )
    record(
        "stray RANK=1 WORLD_SIZE=2",
        run([*TINY, f"hydra.run.dir={work / 'env2'}"], work, env=child_env(RANK="1", WORLD_SIZE="2")),
        "RANK=1",
        work / "env2",
    )
    record(
        "stray WORLD_SIZE=1 with trainer.num_nodes=2",
        run(
            [*TINY, "trainer.num_nodes=2", "strategy=ddp", f"hydra.run.dir={work / 'env3'}"],
            work,
            timeout=120,
            env=child_env(WORLD_SIZE="1"),
        ),
        "WORLD_SIZE=1",
        work / "env3",
    )
    (work / "a_directory").mkdir()
    gate = [sys.executable, "-m", "amp_plugin.app.gate", "precision=fp16", "--against", "bf16", *TINY]
    record(
        "amp-gate: --json a directory",
        run([], work, command=[*gate, "--json", "a_directory", "--dir", str(work / "gate")]),
        "--json",
        None,
    )
    record(
        "AMP_PLUGIN_CONFIG_DIR pointing nowhere",
        run(
            TINY,
            work,
            env=child_env(AMP_PLUGIN_CONFIG_DIR=str(work / "nowhere")),
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
