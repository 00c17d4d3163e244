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
- Reusing a directory that holds a run (resume in place, overwrite) is
  :mod:`amp_plugin.app.reuse`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import secrets
import socket
import time
from pathlib import Path

from amp_plugin.app.validation import ConfigError

__all__ = [
    "FAILED_FILE",
    "OWNER_ENV",
    "RESOLVER",
    "RUN_FILE",
    "RunDirError",
    "RunDirGone",
    "check_empty",
    "claim",
    "holder",
    "mark_failed",
    "read_run_id",
    "register_resolver",
    "release",
    "run_id",
    "secondary_rank",
    "spawned_by_owner",
    "write_run_id",
]

RESOLVER = "amp_run_id"
FAILED_FILE = "FAILED"
LOCK_FILE = ".lock"
OWNER_ENV = "AMP_PLUGIN_RUN_DIR_OWNER"
"""Set while this process holds a run directory's lock: its DDP children share the directory."""

RUN_FILE = ".amp_run"
"""Written when a run starts in a directory: its run id, which every checkpoint of the run carries."""

_held: dict[str, int] = {}  # realpath -> file descriptor holding the flock


class RunDirError(ConfigError):
    """The run directory is in use by another run, or holds a finished one."""


class RunDirGone(OSError):
    """The run directory was deleted while the run was writing to it.

    Attributes:
        directory: the run directory.
        step: the step at which the run noticed.
    """

    def __init__(self, directory: str | os.PathLike[str], step: int | None = None) -> None:
        self.directory = os.fspath(directory)
        self.step = step
        at = f" (noticed at step {step})" if step is not None else ""
        super().__init__(
            errno.ENOENT,
            f"hydra.run.dir={self.directory} was deleted while the run was writing to it{at}: nothing more of this "
            "run can be saved there, so it stopped. Start it again in an existing directory (or drop hydra.run.dir= "
            "for a fresh one).",
        )

    def __str__(self) -> str:
        return self.strerror or super().__str__()


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
    lock = os.path.join(path, LOCK_FILE)
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        reason = f"[Errno {err.errno}] {err.strerror}" if err.errno else str(err)
        raise RunDirError(
            f"{key}={path} cannot be written ({reason}): the run could write none of its files there. Make it "
            f"writable, or point the run at a writable directory ({key}=...)."
        ) from None
    while True:
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
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    info = f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode() + b"\n", 0)
    _held[path] = fd
    os.environ[OWNER_ENV] = path


def holder(directory: str | os.PathLike[str]) -> str | None:
    """Who holds ``directory``'s lock (``"pid ... on ..., started ..."``), or None when no live process does."""
    lock = os.path.join(os.path.realpath(directory), LOCK_FILE)
    if os.path.realpath(directory) in _held:
        return None
    try:
        import fcntl

        fd = os.open(lock, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return None


def check_empty(directory: str, key: str) -> None:
    """``hydra.run.dir=''`` (or the sweep's): Hydra would write the run into the current directory.

    Raises:
        RunDirError: ``directory`` is empty or blank.
    """
    if not directory.strip():
        raise RunDirError(
            f"{key}={directory!r} is not allowed: an empty directory would put the run's files into the current "
            f"directory ({os.getcwd()}). Give a directory ({key}=outputs/my_run), or drop {key}= for a fresh one."
        )


def write_run_id(directory: str | os.PathLike[str], run: str) -> None:
    """Record ``run`` as the id of the run writing into ``directory`` (:data:`RUN_FILE`)."""
    path = Path(directory) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)  # train() outside Hydra: nothing created it yet
    tmp = path.with_name(f"{RUN_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"run_id": run, "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    os.replace(tmp, path)


def read_run_id(directory: str | os.PathLike[str]) -> str | None:
    """The id in ``directory``'s :data:`RUN_FILE`, or None (no run of this version started there)."""
    try:
        value = json.loads((Path(directory) / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


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
