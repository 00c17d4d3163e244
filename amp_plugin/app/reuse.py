"""Reusing a run directory that already holds a run: resume in place, overwrite, or refuse.

:func:`check_reuse` refuses a directory that already holds another run's outputs, unless
the run resumes from one of that run's own checkpoints inside it
(``ckpt_path=<dir>/checkpoints/last.ckpt``; the run id in :data:`~amp_plugin.app.rundir.RUN_FILE`
and in the checkpoint must match) or ``overwrite=true`` asks to replace them (:func:`clear_outputs`).
Overwriting deletes only what the run in the directory wrote: a directory without
:data:`~amp_plugin.app.rundir.RUN_FILE`, with files in ``logs/`` or ``checkpoints/`` that no run
writes, or with a checkpoint that another run wrote (its run id is not the directory's), is refused,
naming the file, and nothing is deleted.

:func:`check_reuse` only decides; the deleting waits until the new run has passed every check
(:func:`amp_plugin.app.run.train` calls :func:`clear_outputs`), so bad input changes nothing.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from amp_plugin.app.rundir import FAILED_FILE, RUN_FILE, RunDirError, read_run_id, secondary_rank, spawned_by_owner

__all__ = [
    "OUTPUTS",
    "check_reuse",
    "checkpoint_run_id",
    "clear_outputs",
    "foreign_checkpoints",
    "foreign_files",
    "outputs_in",
    "refuse_overwrite",
]

# What a run writes (besides .hydra/ and the job log): their presence means the directory is taken.
OUTPUTS = ("summary.json", "training_curves.csv", "training_curves.png", "logs", "checkpoints")
_CLEARED = (*OUTPUTS, FAILED_FILE, RUN_FILE)
# The files a run writes inside logs/ and checkpoints/ (the loggers, the monitors, the checkpoints).
_WRITTEN = {
    "logs": (
        "metrics.csv",
        "metrics.csv.unreadable",  # a damaged metrics.csv a resume in place kept (resume.keep_history)
        "hparams.yaml",
        "scale_events.csv",
        "grad_health.csv",
        "fp8_stats.csv",
        "events.out.tfevents.*",
    ),
    "checkpoints": ("*.ckpt", ".partial-*.tmp"),
}


def outputs_in(directory: Path) -> list[str]:
    """The run outputs present in ``directory`` (non-empty ``logs/`` and ``checkpoints/`` count)."""
    found = []
    for name in OUTPUTS:
        path = directory / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def _inside(path: str, directory: Path) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(directory))
    except ValueError:
        return False
    return True


def check_reuse(
    directory: str | os.PathLike[str], ckpt_path: str | None, overwrite: bool, key: str = "hydra.run.dir"
) -> bool:
    """Refuse a directory holding another run's outputs (see the module docstring).

    Returns:
        Whether the directory's outputs are to be deleted (``overwrite`` and a directory holding a run);
        the caller deletes them (:func:`clear_outputs`) once the run has passed every other check.

    Raises:
        RunDirError: the directory holds a run and this one neither resumes it nor may overwrite it.
    """
    directory = Path(directory)
    if spawned_by_owner(directory):
        return False  # a DDP child of the run that checked it
    if secondary_rank() or not directory.is_dir():
        return False  # a rank other than 0 that joined its rank 0 (rundir.claim checked that)
    found = outputs_in(directory)
    if not found:
        return False
    if ckpt_path is not None and _inside(ckpt_path, directory):
        _check_own_checkpoint(directory, ckpt_path, key)
        return False  # resuming in place: the run continues its own files
    if overwrite:
        refuse_overwrite(directory, key)
        return True
    finished = "a finished run" if (directory / "summary.json").is_file() else "another run's outputs"
    resume = directory / "checkpoints" / "last.ckpt"
    hint = f"resume it with ckpt_path={resume} {key}={directory}, " if resume.is_file() else ""
    raise RunDirError(
        f"{key}={directory} already holds {finished} ({', '.join(found)}); this run would overwrite or mix with "
        f"it. To continue: {hint}drop {key}= for a fresh directory, or add overwrite=true to replace it."
    )


def _check_own_checkpoint(directory: Path, ckpt_path: str, key: str) -> None:
    """Resuming in place continues the run whose directory it is: the checkpoint must be one of its own."""
    from amp_plugin.app.validation import load_checkpoint

    try:
        checkpoint = load_checkpoint(ckpt_path)
    except Exception:  # unreadable: validate() names the file and the reason
        return
    if not isinstance(checkpoint, dict):
        return
    app = checkpoint.get("amp_plugin_app")
    theirs = app.get("run_id") if isinstance(app, dict) else None
    ours = read_run_id(directory)
    if theirs == ours:
        return
    written = f"run {theirs}" if theirs else "a run that recorded no run id"
    raise RunDirError(
        f"ckpt_path={ckpt_path} is not allowed in place: it was written by {written}, not by the run in "
        f"{key}={directory} (run {ours or 'unknown'}), and resuming would replace this run's history from its step "
        f"on. Resume it into a fresh directory (drop {key}=), or resume this run from its own checkpoints/last.ckpt."
    )


def foreign_files(directory: str | os.PathLike[str]) -> list[str]:
    """Files in ``directory``'s ``logs/`` and ``checkpoints/`` that no run writes (relative paths)."""
    directory = Path(directory)
    found = []
    for sub, patterns in _WRITTEN.items():
        folder = directory / sub
        if not folder.is_dir() or folder.is_symlink():
            continue
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if path.is_dir() and not path.is_symlink():
                continue
            if len(rel.parts) > 1 or not any(fnmatch.fnmatch(rel.name, p) for p in patterns):
                found.append(f"{sub}/{rel}")
    return found


def checkpoint_run_id(path: str | os.PathLike[str]) -> str | None:
    """The run id a checkpoint carries (``amp_plugin_app.run_id``), or None (unreadable, or none recorded).

    Memory-mapped: the tensors' bytes are not read."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # not a checkpoint of this project
        return None
    app = checkpoint.get("amp_plugin_app") if isinstance(checkpoint, dict) else None
    value = app.get("run_id") if isinstance(app, dict) else None
    return value if isinstance(value, str) else None


def foreign_checkpoints(directory: str | os.PathLike[str]) -> list[str]:
    """The ``checkpoints/*.ckpt`` of ``directory`` that the run recorded in its :data:`RUN_FILE` did not
    write (another run's, a user's own, or unreadable), as relative paths."""
    directory = Path(directory)
    ours = read_run_id(directory)
    folder = directory / "checkpoints"
    if not folder.is_dir() or folder.is_symlink():
        return []
    return [
        f"checkpoints/{path.name}"
        for path in sorted(folder.glob("*.ckpt"))
        if path.is_symlink() or not path.is_file() or ours is None or checkpoint_run_id(path) != ours
    ]


def clear_outputs(directory: str | os.PathLike[str], key: str = "hydra.run.dir") -> None:
    """Delete what a run wrote into ``directory`` (``.hydra/`` and the job log stay).

    Raises:
        RunDirError: ``directory`` holds outputs but no :data:`RUN_FILE` (no run of this project
            wrote them), files in ``logs/`` or ``checkpoints/`` that no run writes, or a checkpoint
            another run wrote; nothing is deleted.
    """
    directory = Path(directory)
    refuse_overwrite(directory, key)
    for name in _CLEARED:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def refuse_overwrite(directory: str | os.PathLike[str], key: str = "hydra.run.dir") -> None:
    """Raise :class:`RunDirError` when :func:`clear_outputs` would delete what no run of this project wrote."""
    directory = Path(directory)
    found = outputs_in(directory)
    if not found:
        return
    foreign = foreign_files(directory)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise RunDirError(
            f"overwrite=true is not allowed for {key}={directory}: it holds files that no run writes ({shown}), "
            "and overwriting would delete them. Move them elsewhere first, or give this run its own directory "
            f"(drop {key}=)."
        )
    ours = read_run_id(directory)
    if ours is None:
        why = "it is unreadable" if (Path(directory) / RUN_FILE).exists() else "there is none"
        raise RunDirError(
            f"overwrite=true is not allowed for {key}={directory}: no {RUN_FILE} file says which run wrote its "
            f"{', '.join(found)} ({why}), so overwriting could delete files of yours. Delete them yourself if they "
            f"can go, or give this run its own directory (drop {key}=)."
        )
    others = foreign_checkpoints(directory)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RunDirError(
            f"overwrite=true is not allowed for {key}={directory}: {shown} was not written by the run in it (run "
            f"{ours}; it is another run's checkpoint, a file of yours, or unreadable), and overwriting would delete "
            f"it. Move it elsewhere first, or give this run its own directory (drop {key}=)."
        )
