"""Run directories: a unique default name, one writer at a time, and no silent overwrite.

- :func:`run_id` (the ``${amp_run_id:}`` resolver of ``configs/train.yaml``) names the default
  run directory ``outputs/<date>/<HH-MM-SS>-<ms>-<4 hex digits>``: two runs started in the same
  millisecond still get different directories.
- :func:`claim` takes an exclusive ``flock`` on ``<dir>/.lock`` for as long as the run writes
  there (:func:`release` removes the file). The operating system drops the lock when the
  process dies, so a run killed with SIGKILL never leaves a stale one: at most an unlocked
  ``.lock`` file, which the next run takes. A second run into a held directory gets
  :class:`RunDirError`. Ranks of one run share the directory: the launching process holds the
  lock for its DDP children (they inherit :data:`OWNER_ENV`), and under torchrun or SLURM only
  global rank 0 takes it.
- :func:`check_reuse` refuses a directory that already holds another run's outputs, unless
  the run resumes from a checkpoint inside it (``ckpt_path=<dir>/checkpoints/last.ckpt``) or
  ``overwrite=true`` asks to replace them (:func:`clear_outputs`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from amp_plugin.app.validation import ConfigError

__all__ = [
    "FAILED_FILE",
    "OWNER_ENV",
    "RESOLVER",
    "RunDirError",
    "check_reuse",
    "claim",
    "clear_outputs",
    "mark_failed",
    "outputs_in",
    "register_resolver",
    "release",
    "run_id",
    "secondary_rank",
    "spawned_by_owner",
]

RESOLVER = "amp_run_id"
FAILED_FILE = "FAILED"
LOCK_FILE = ".lock"
OWNER_ENV = "AMP_PLUGIN_RUN_DIR_OWNER"
"""Set while this process holds a run directory's lock: its DDP children share the directory."""

# What a run writes (besides .hydra/ and the job log): their presence means the directory is taken.
OUTPUTS = ("summary.json", "training_curves.csv", "training_curves.png", "logs", "checkpoints")
_CLEARED = (*OUTPUTS, FAILED_FILE)

_held: dict[str, int] = {}  # realpath -> file descriptor holding the flock


class RunDirError(ConfigError):
    """The run directory is in use by another run, or holds a finished one."""


def run_id() -> str:
    """``<date>/<HH-MM-SS>-<milliseconds>-<4 random hex digits>``: unique per run, sorts by start time."""
    now = datetime.datetime.now()
    return now.strftime("%Y-%m-%d/%H-%M-%S-") + f"{now.microsecond // 1000:03d}-{secrets.token_hex(2)}"


def register_resolver() -> None:
    """Register ``${amp_run_id:}`` (cached: every use in one config gives the same name)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, run_id, use_cache=True)


def secondary_rank() -> bool:
    """Whether an external launcher (torchrun, SLURM, MPI) started this process as a rank other than 0."""
    env = os.environ
    world = next((env[k] for k in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE") if env.get(k)), "1")
    rank = next((env[k] for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK") if env.get(k)), "0")
    try:
        return int(world) > 1 and int(rank) != 0
    except ValueError:
        return False


def spawned_by_owner(directory: str | os.PathLike[str]) -> bool:
    """Whether this process was started by the process that holds ``directory`` (a DDP child of it)."""
    path = os.path.realpath(directory)
    return os.environ.get(OWNER_ENV) == path and path not in _held


def _shared_with_this_run(path: str) -> bool:
    return path in _held or os.environ.get(OWNER_ENV) == path or secondary_rank()


def claim(directory: str | os.PathLike[str], key: str = "hydra.run.dir") -> None:
    """Hold ``directory``'s lock until :func:`release` or the end of the process.

    Raises:
        RunDirError: another live process holds it.
    """
    path = os.path.realpath(directory)
    if _shared_with_this_run(path):
        return
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no lock
        return
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, LOCK_FILE)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(
                f"{key}={path} is in use by a run that is still writing to it ({holder}). Wait for it to end, or "
                f"give this run its own directory (drop {key}= to get a fresh one)."
            ) from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed the file as we locked it: lock the new one
    info = f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode() + b"\n", 0)
    _held[path] = fd
    os.environ[OWNER_ENV] = path


def release(directory: str | os.PathLike[str]) -> None:
    """Drop the lock :func:`claim` took (no-op if this process does not hold it)."""
    path = os.path.realpath(directory)
    fd = _held.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, LOCK_FILE))  # while still held: a waiting run re-checks the file
        os.close(fd)
    if os.environ.get(OWNER_ENV) == path:
        del os.environ[OWNER_ENV]


def mark_failed(output_dir: Path, err: BaseException, text: str | None = None) -> None:
    """Leave a ``FAILED`` note (``text``, default the error) in an existing run directory.

    Hydra creates the directory before the job. Written by the launching process only (not by
    DDP ranks > 0), and never fatal: on a full disk the note may be all that cannot be written.
    """
    if not Path(output_dir).is_dir() or _launched_rank() != 0 or spawned_by_owner(output_dir):
        return  # a rank that Lightning's launcher started (LOCAL_RANK set, but no WORLD_SIZE) writes nothing
    with contextlib.suppress(OSError):
        (Path(output_dir) / FAILED_FILE).write_text(text if text is not None else f"{type(err).__name__}: {err}\n")


def _launched_rank() -> int:
    """This process's global rank as its launcher set it (0 without a launcher)."""
    env = os.environ
    world = env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or "1"
    if not world.isdigit() or int(world) <= 1:
        return 0
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


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
) -> None:
    """Refuse a directory holding another run's outputs (see the module docstring).

    With ``overwrite``, those outputs are deleted first (:func:`clear_outputs`).

    Raises:
        RunDirError: the directory holds a run and this one neither resumes it nor overwrites it.
    """
    directory = Path(directory)
    if spawned_by_owner(directory):
        return  # a DDP child of the run that checked it
    if secondary_rank() or not directory.is_dir():
        return
    found = outputs_in(directory)
    if not found:
        return
    if ckpt_path is not None and _inside(ckpt_path, directory):
        return  # resuming in place: the run continues its own files
    if overwrite:
        clear_outputs(directory)
        return
    finished = "a finished run" if (directory / "summary.json").is_file() else "another run's outputs"
    resume = directory / "checkpoints" / "last.ckpt"
    hint = f"resume it with ckpt_path={resume} {key}={directory}, " if resume.is_file() else ""
    raise RunDirError(
        f"{key}={directory} already holds {finished} ({', '.join(found)}); this run would overwrite or mix with "
        f"it. To continue: {hint}drop {key}= for a fresh directory, or add overwrite=true to replace it."
    )


def clear_outputs(directory: str | os.PathLike[str]) -> None:
    """Delete what a run wrote into ``directory`` (``.hydra/`` and the job log stay)."""
    directory = Path(directory)
    for name in _CLEARED:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
