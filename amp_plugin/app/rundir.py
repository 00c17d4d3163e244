"""Run directories: a unique default name, one writer at a time, and no silent overwrite.

- :func:`run_id` (the ``${amp_run_id:}`` resolver of ``configs/train.yaml``) names the default
  run directory ``outputs/<date>/<HH-MM-SS>-<ms>-<4 hex digits>``: two runs started in the same
  millisecond still get different directories.
- :func:`claim` takes an exclusive ``flock`` on ``<dir>/.lock`` for as long as the run writes
  there (:func:`release` removes the file). The operating system drops the lock when the
  process dies, so a run killed with SIGKILL never leaves a stale one: at most an unlocked
  ``.lock`` file, which the next run takes. A second run into a held directory gets
  :class:`RunDirError`. Ranks of one run share the directory: the launching process holds the
  lock for its DDP children (they inherit :data:`OWNER_ENV` and a token that the lock file
  repeats), and under torchrun or SLURM only global rank 0 takes it; every other rank joins only
  a directory whose lock a live rank 0 of the same launch holds (:func:`launch_id`). No guard is
  switched off by environment variables alone: a ``RANK`` or token left over from another run,
  without that live holder, is refused in one line.
- A directory that holds another run's outputs is :func:`protect`-ed until the run has passed every
  check and takes it over (:func:`adopt`): a refused run writes no ``FAILED`` note there.
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
from typing import Any

from amp_plugin.app.validation import ConfigError

__all__ = [
    "FAILED_FILE",
    "HYDRA_RECORD",
    "OWNER_ENV",
    "RESOLVER",
    "RUN_FILE",
    "RunDirError",
    "RunDirGone",
    "adopt",
    "check_empty",
    "claim",
    "holder",
    "launch_id",
    "mark_failed",
    "protect",
    "read_run_id",
    "register_resolver",
    "release",
    "run_id",
    "secondary_rank",
    "spawned_by_owner",
    "write_hydra_record",
    "write_run_id",
]

RESOLVER = "amp_run_id"
FAILED_FILE = "FAILED"
LOCK_FILE = ".lock"
OWNER_ENV = "AMP_PLUGIN_RUN_DIR_OWNER"
"""Set while this process holds a run directory's lock: its DDP children share the directory."""
TOKEN_ENV = "AMP_PLUGIN_RUN_DIR_TOKEN"
"""With :data:`OWNER_ENV`: a random token the holder also writes into the lock file. A child joins the
directory only while a live process holds the lock with this token, so a leftover variable joins nothing."""
LAUNCH_ENV = (
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "OMPI_MCA_orte_hnp_uri",
    "PMIX_NAMESPACE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What identifies one launch of a torchrun, SLURM or MPI job (see :func:`launch_id`)."""
JOIN_SECONDS = 60.0
"""How long a rank other than 0 waits for its rank 0 to take the run directory."""

RUN_FILE = ".amp_run"
"""Written when a run starts in a directory: its run id, which every checkpoint of the run carries."""

HYDRA_RECORD = ".hydra"
"""Where the run records its config, Hydra's config and the overrides (``hydra.output_subdir`` is null in
``configs/train.yaml``, so that Hydra writes nothing into the directory before the run's checks)."""

_held: dict[str, int] = {}  # realpath -> file descriptor holding the flock
_protected: set[str] = set()  # realpaths holding another run's outputs that this run has not taken over


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
    """Whether the environment says that a launcher (torchrun, SLURM, MPI) started this process as a rank
    other than 0. Only a hint: :func:`claim` checks that a live rank 0 of the same launch holds the directory."""
    env = os.environ
    world = next((env[k] for k in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE") if env.get(k)), "1")
    rank = next((env[k] for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK") if env.get(k)), "0")
    try:
        return int(world) > 1 and int(rank) != 0
    except ValueError:
        return False


def _rank_variables() -> str:
    env = os.environ
    keys = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
    return " ".join(f"{k}={env[k]}" for k in keys if env.get(k))


def launch_id() -> str | None:
    """What the environment says of the launch this process belongs to (torchrun's run id, SLURM's job
    and step, the rendezvous address), or None when no launcher set any of it."""
    parts = [f"{k}={os.environ[k]}" for k in LAUNCH_ENV if os.environ.get(k)]
    return " ".join(parts) or None


def _lock_info(fd: int) -> dict[str, str]:
    """The holder's lines in a lock file: ``who`` (pid, host, start), ``token`` and ``launch``."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    info = {"who": text.splitlines()[0].strip() if text.strip() else "another process"}
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(": ")
        if key in ("token", "launch"):
            info[key] = value.strip()
    return info


def _live_holder(path: str) -> dict[str, str] | None:
    """The lock file's lines while a live process holds ``path``'s lock, else None."""
    try:
        import fcntl

        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _lock_info(fd)
        return None
    finally:
        os.close(fd)  # closing drops the probe's shared lock


def spawned_by_owner(directory: str | os.PathLike[str]) -> bool:
    """Whether this process was started by the process that holds ``directory`` (a DDP child of it): the
    inherited :data:`OWNER_ENV` names the directory and a live holder's lock file has the inherited token."""
    path = os.path.realpath(directory)
    if os.environ.get(OWNER_ENV) != path or path in _held:
        return False
    token = os.environ.get(TOKEN_ENV)
    live = _live_holder(path)
    return bool(token) and live is not None and live.get("token") == token


def _join_launch(path: str, key: str) -> None:
    """A rank other than 0 shares its rank 0's directory: wait (up to :data:`JOIN_SECONDS`) until a live
    process of the same launch holds it.

    Raises:
        ConfigError: no launcher identity in the environment, or no rank 0 of this launch took the directory.
    """
    launch, ranks = launch_id(), _rank_variables()
    if launch is None:
        raise ConfigError(
            f"{ranks} is set in the environment, but no launcher started this process (none of "
            f"{', '.join(LAUNCH_ENV)} is set), so there is no rank 0 to share {key}={path} with. Unset RANK and "
            "WORLD_SIZE (a leftover of a distributed launcher?), or start the processes with torchrun, SLURM or "
            "trainer.devices=N."
        )
    deadline = time.monotonic() + JOIN_SECONDS
    while True:
        live = _live_holder(path)
        if live is not None and live.get("launch") == launch:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    other = f" (it is held by another run: {live['who']})" if live is not None else ""
    raise ConfigError(
        f"{ranks} is set in the environment, but no rank 0 of this launch ({launch}) took {key}={path} within "
        f"{JOIN_SECONDS:g} s{other}: this process is not part of a running distributed job. Unset RANK and "
        "WORLD_SIZE (a leftover of a distributed launcher?), or give every rank the same hydra.run.dir."
    )


def claim(directory: str | os.PathLike[str], key: str = "hydra.run.dir") -> None:
    """Hold ``directory``'s lock until :func:`release` or the end of the process.

    A DDP child of the holder, or a rank other than 0 of the holder's launch, shares the lock instead.

    Raises:
        RunDirError: another live process holds it.
        ConfigError: the environment says this is a rank other than 0, but no rank 0 of this launch holds it.
    """
    path = os.path.realpath(directory)
    if path in _held or spawned_by_owner(path):
        return
    if secondary_rank():
        _join_launch(path, key)
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
            who = _lock_info(fd)["who"]
            os.close(fd)
            raise RunDirError(
                f"{key}={path} is in use by a run that is still writing to it ({who}). Wait for it to end, or "
                f"give this run its own directory (drop {key}= to get a fresh one)."
            ) from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed the file as we locked it: lock the new one
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    token = secrets.token_hex(16)
    info = f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    info += f"token: {token}\n"
    launch = launch_id()
    if launch is not None:
        info += f"launch: {launch}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    _held[path] = fd
    os.environ[OWNER_ENV] = path
    os.environ[TOKEN_ENV] = token


def protect(directory: str | os.PathLike[str]) -> None:
    """Until :func:`adopt`, write no ``FAILED`` note into ``directory``: it holds another run's outputs."""
    _protected.add(os.path.realpath(directory))


def adopt(directory: str | os.PathLike[str]) -> None:
    """The run passed every check and takes ``directory`` over (overwrite, resume in place)."""
    _protected.discard(os.path.realpath(directory))


def holder(directory: str | os.PathLike[str]) -> str | None:
    """Who holds ``directory``'s lock (``"pid ... on ..., started ..."``), or None when no live process does."""
    path = os.path.realpath(directory)
    if path in _held:
        return None
    live = _live_holder(path)
    return live["who"] if live is not None else None


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
        os.environ.pop(TOKEN_ENV, None)
    _protected.discard(path)


def mark_failed(output_dir: Path, err: BaseException, text: str | None = None) -> bool:
    """Leave a ``FAILED`` note (``text``, default the error) in an existing run directory; whether it did.

    Hydra creates the directory before the job. Written by the launching process only (not by
    DDP ranks > 0), never into a :func:`protect`-ed directory, and never fatal: on a full disk the
    note may be all that cannot be written.
    """
    if not Path(output_dir).is_dir() or _launched_rank() != 0 or spawned_by_owner(output_dir):
        return False  # a rank that Lightning's launcher started (LOCAL_RANK set, but no WORLD_SIZE) writes nothing
    if os.path.realpath(output_dir) in _protected:
        return False  # another run's directory, not taken over: a refused run changes nothing there
    try:
        (Path(output_dir) / FAILED_FILE).write_text(text if text is not None else f"{type(err).__name__}: {err}\n")
    except OSError:
        return False
    return True


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


def write_hydra_record(output_dir: str | os.PathLike[str], cfg: Any) -> None:
    """What Hydra writes into ``<run dir>/.hydra/`` when ``hydra.output_subdir`` is set, written now."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    try:
        hydra_cfg = HydraConfig.instance().cfg
        hydra_node = HydraConfig.get()
    except ValueError:  # train() outside @hydra.main
        return
    if hydra_cfg is None or hydra_node.output_subdir is not None:
        return  # Hydra wrote it itself (hydra.output_subdir=... on the command line, or a DDP child's)
    if os.path.realpath(str(hydra_node.runtime.output_dir)) != os.path.realpath(output_dir):
        return
    record = Path(output_dir) / HYDRA_RECORD
    record.mkdir(parents=True, exist_ok=True)
    (record / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (record / "hydra.yaml").write_text(OmegaConf.to_yaml(hydra_cfg))
    (record / "overrides.yaml").write_text(OmegaConf.to_yaml(hydra_node.overrides.task))
