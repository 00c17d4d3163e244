"""The checks no constructor can make: keys that depend on each other, and the app's own keys.

Every argument of a loss scaler, the precision settings, the fault injector, a recipe, a
callback, a logger or the Trainer is checked by the constructor that takes it
(:mod:`amp_plugin.app.build` names the config key in its message), and the schemas
(:mod:`amp_plugin.app.schema`) type every key while Hydra composes the config. What is left is
here, and runs once per run, before Lightning is imported:

- a group without a choice (``precision``, ``scaler``, ``recipe``, ``trainer``);
- ``trainer.precision``, which would fight the precision group;
- Trainer arguments Lightning accepts and then divides by in the middle of a run
  (``accumulate_grad_batches``, ``check_val_every_n_epoch``, ``val_check_interval`` 0), or trains
  nothing with (``limit_train_batches``, ``max_steps``, ``max_epochs`` 0), a NaN
  ``gradient_clip_val``, ``num_nodes`` above 1 without a cluster environment, and a
  ``WORLD_SIZE`` in the environment that is not ``num_nodes`` x the processes per node (hangs);
- the strategy: Lightning strategies that refuse the plugin (FSDP1, DeepSpeed), and more CPU
  processes than the machine has cores;
- the app's own keys: ``seed``, ``num_threads``, and ``ckpt_path`` (a readable Lightning
  checkpoint that leaves something to train before ``trainer.max_steps``);
- ``AMP_PLUGIN_FUSED_BUILD_TIMEOUT`` (:func:`amp_plugin.fused.build_timeout`), read by the first
  build of the fused kernels in the middle of a run;
- fault steps at or past ``trainer.max_steps``: a warning, since they never happen.

Every failure is a :class:`ConfigError` whose message names the key, repeats the value and
says what is allowed.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from amp_plugin import fused
from amp_plugin._checksum import verify_checksum
from amp_plugin.settings import PRESETS

__all__ = ["ConfigError", "forget_checkpoints", "load_checkpoint", "process_count", "show", "validate"]

GROUPS = ("precision", "scaler", "recipe", "trainer")


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which key, what it got and what is allowed."""


def show(value: Any) -> str:
    """A value as it would be written on the command line (``true``, ``65536``, ``'abc'``, ``[3,7]``)."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


def _at_least(key: str, value: int | None, minimum: int, hint: str = "") -> None:
    if value is not None and value < minimum:
        raise ConfigError(
            f"{key}={show(value)} is not allowed: {key} must be an integer >= {minimum}." + (f" {hint}" if hint else "")
        )


def validate(cfg: DictConfig) -> None:
    """Check what the constructors cannot (see the module docstring); raise :class:`ConfigError`.

    Types, unknown keys and choices were already checked by the schemas while Hydra composed
    ``cfg``. Apart from reading ``ckpt_path``, nothing touches disk.
    """
    for key in GROUPS:
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"{key} is missing: choose one with {key}=NAME (see configs/{key}/).")
    trainer = cfg.trainer
    if trainer.get("precision") is not None:
        raise ConfigError(
            f"trainer.precision={show(trainer.precision)} is not allowed: the precision comes from the precision "
            f"group (precision={'|'.join(PRESETS)}); drop trainer.precision."
        )
    # Lightning's Trainer takes 0 for these and fails with a ZeroDivisionError at the first step.
    _at_least("trainer.accumulate_grad_batches", trainer.accumulate_grad_batches, 1)
    _at_least("trainer.check_val_every_n_epoch", trainer.check_val_every_n_epoch, 1)
    _check_trainer_amounts(trainer)
    _check_strategy(trainer)
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={show(cfg.seed)} is not allowed: seed must be an integer in [0, 2**32 - 1].")
    _at_least(
        "num_threads", cfg.num_threads, 1, "It sets torch.set_num_threads for the run; null keeps PyTorch's default."
    )
    try:
        fused.build_timeout()
    except ValueError as err:
        raise ConfigError(f"{err}.") from None
    if cfg.ckpt_path is not None:
        _check_checkpoint(cfg.ckpt_path, trainer.max_steps)
    _warn_unreachable_faults(cfg.get("fault"), trainer.max_steps)


def _check_trainer_amounts(trainer: DictConfig) -> None:
    """Trainer values Lightning takes and then trains nothing with, divides by, or misreports."""
    for key in ("limit_train_batches", "limit_val_batches", "val_check_interval"):
        value = trainer.get(key)
        if isinstance(value, bool):  # Lightning reads true as 1 batch and false as 0
            raise ConfigError(
                f"trainer.{key}={show(value)} is not allowed: trainer.{key} must be a batch count (an integer) or a "
                "fraction of an epoch (a float), or null for all of it; a boolean would be read as 1 or 0 batches."
            )
    for key in ("limit_train_batches", "val_check_interval"):
        value = trainer.get(key)
        if value is None or not isinstance(value, (int, float)):
            continue  # a string or another type: Lightning's own check names it
        if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0.0 < value <= 1.0):
            why = "it trains nothing" if key == "limit_train_batches" else "Lightning divides by it"
            raise ConfigError(
                f"trainer.{key}={show(value)} is not allowed ({why}): trainer.{key} must be a batch count >= 1 or "
                "a fraction of an epoch in (0, 1], or null for all of it."
            )
    if trainer.max_steps == 0:  # Lightning names the negative values itself
        raise ConfigError(
            "trainer.max_steps=0 is not allowed: it trains nothing. trainer.max_steps must be an integer >= 1, or -1 "
            "for no step limit (then trainer.max_epochs ends the run)."
        )
    if trainer.max_epochs is not None and (trainer.max_epochs == 0 or trainer.max_epochs < -1):
        raise ConfigError(
            f"trainer.max_epochs={show(trainer.max_epochs)} is not allowed: trainer.max_epochs must be an integer "
            ">= 1, -1 for no epoch limit, or null (trainer.max_steps ends the run)."
        )
    clip = trainer.gradient_clip_val
    if clip is not None and not (math.isfinite(clip) and clip >= 0):
        raise ConfigError(
            f"trainer.gradient_clip_val={show(clip)} is not allowed: trainer.gradient_clip_val must be a finite "
            "number >= 0 (the largest gradient norm or value kept), or null for no clipping."
        )
    if trainer.num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={show(trainer.num_nodes)} is not allowed: it must be an integer >= 1.")
    if trainer.num_nodes > 1 and not any(os.environ.get(k) for k in CLUSTER_ENV):
        raise ConfigError(
            f"trainer.num_nodes={show(trainer.num_nodes)} is not allowed here: no cluster environment is set (none of "
            f"{', '.join(CLUSTER_ENV)}), so the other machines never join and the run would wait for them forever. "
            "Start it on each machine with SLURM (srun), torchrun or mpirun, or set MASTER_ADDR, NODE_RANK and "
            "WORLD_SIZE; on one machine use trainer.num_nodes=1."
        )
    _check_world_size(trainer)


def _check_world_size(trainer: DictConfig) -> None:
    """A ``WORLD_SIZE`` in the environment must hold ``num_nodes`` x the processes per node: otherwise the
    process group waits forever for processes that never start (or Lightning refuses it mid-setup)."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world:
        return
    processes = process_count(trainer) or 1
    wanted = trainer.num_nodes * processes
    if not world.isdigit() or int(world) != wanted:
        raise ConfigError(
            f"WORLD_SIZE={world} is set in the environment, but trainer.num_nodes={show(trainer.num_nodes)} x "
            f"trainer.devices={show(trainer.devices)} asks for {wanted} processes, so the process group would wait "
            f"forever for the missing ones. Unset WORLD_SIZE (a leftover of a distributed launcher?), or launch "
            f"{wanted} processes (torchrun --nnodes {trainer.num_nodes} --nproc-per-node {processes}, srun) with "
            "matching trainer.num_nodes and trainer.devices."
        )


# What a launcher of a multi-machine job sets (SLURM, torchrun, MPI, LSF, or by hand for Lightning).
CLUSTER_ENV = ("SLURM_NTASKS", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "OMPI_COMM_WORLD_SIZE", "LSB_JOBID")


# Lightning strategies whose precision plugin must be their own (FSDPPrecision, DeepSpeedPrecision).
_OWN_PRECISION = {
    "fsdp_": "Lightning's FSDPStrategy (FSDP1) takes only its own FSDPPrecision plugin",
    "deepspeed": "DeepSpeed brings its own loss scaler and master weights",
}


def process_count(trainer: DictConfig) -> int | None:
    """The processes per machine that ``trainer.devices`` asks for: the count it names, every
    GPU for ``-1``/``"auto"`` on a GPU machine, None where Lightning decides (one CPU process)."""
    devices = trainer.devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    if OmegaConf.is_list(devices) or isinstance(devices, list):
        return len(devices)
    on_gpu = trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    return torch.cuda.device_count() if on_gpu and devices in (-1, "auto") else None


def _check_strategy(trainer: DictConfig) -> None:
    strategy = str(trainer.strategy)
    if any(word in strategy for word in ("spawn", "fork", "notebook")):
        raise ConfigError(
            f"trainer.strategy={strategy!r} is not allowed: its worker processes train while this one waits, and "
            "Lightning gives this one back no step count, so the app's summary, failure checks and resume "
            "command would see a run that took no step. Use strategy=ddp (its processes start with this command "
            "line and each runs the app)."
        )
    for prefix, reason in _OWN_PRECISION.items():
        if strategy.startswith(prefix):
            raise ConfigError(
                f"trainer.strategy={strategy!r} is not allowed: {reason}, so it cannot run this app's precision "
                "plugin. Use strategy=fsdp (FSDP2 through Lightning's ModelParallelStrategy: sharded FP32 master "
                "weights, the app's loss scaling) or strategy=ddp."
            )
    on_cpu = trainer.accelerator == "cpu" or (trainer.accelerator == "auto" and not torch.cuda.is_available())
    count = process_count(trainer)
    cores = os.cpu_count() or 1
    if on_cpu and count is not None and count > cores:
        raise ConfigError(
            f"trainer.devices={show(trainer.devices)} is not allowed: on the CPU each device is a process, and this "
            f"machine has {cores} cores. Use at most trainer.devices={cores}."
        )
    if strategy == "fsdp" and count is None:
        raise ConfigError(
            f"trainer.devices={show(trainer.devices)} is not allowed with strategy=fsdp on the CPU: give the "
            "process count, e.g. trainer.devices=2 (each process holds 1/devices of the model)."
        )


_checkpoints: dict[str, Any] = {}


def load_checkpoint(path: str) -> Any:
    """``torch.load(path)`` on the CPU, once per file version: the checks and the build share it."""
    stat = os.stat(path)
    key = f"{os.path.realpath(path)}:{stat.st_mtime_ns}:{stat.st_size}"
    if key not in _checkpoints:
        _checkpoints.clear()
        _checkpoints[key] = torch.load(path, map_location="cpu", weights_only=False)
    return _checkpoints[key]


def forget_checkpoints() -> None:
    """Drop the cached checkpoint (Lightning reads its own copy when it resumes)."""
    _checkpoints.clear()


def _check_checkpoint(path: str, max_steps: int) -> None:
    """``ckpt_path`` names a readable Lightning checkpoint that is not already at ``max_steps``."""
    written_by = (
        "ckpt_path must be a checkpoint file written by an earlier run, for example "
        "outputs/<date>/<time>/checkpoints/last.ckpt."
    )
    if not os.path.isfile(path):
        where = "a directory" if os.path.isdir(path) else "no such file"
        raise ConfigError(f"ckpt_path={path!r} is not allowed: {where}. {written_by}")
    try:
        checkpoint = load_checkpoint(path)
    except Exception as err:
        reason = " ".join(str(err).split()).split(". ")[0][:200]  # torch's zip errors go on for sentences
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: the file cannot be read as a checkpoint "
            f"({type(err).__name__}: {reason}); it is truncated, corrupt or not a checkpoint. {written_by}"
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: it is not a Lightning checkpoint (no state_dict). {written_by}"
        )
    if verify_checksum(checkpoint) is False:
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: its contents do not match the checksum saved with it, so the file "
            "was damaged after it was written (a disk or copy error) or edited. Resume from another checkpoint of "
            "the run (checkpoints/), or start a new run without ckpt_path."
        )
    _check_saved_scale(path, checkpoint)
    step = int(checkpoint.get("global_step", 0))
    if max_steps != -1 and step >= max_steps:
        raise ConfigError(
            f"trainer.max_steps={max_steps} leaves nothing to train: ckpt_path={path!r} is already at step "
            f"{step}. Set trainer.max_steps above {step} to continue the run."
        )


def _check_saved_scale(path: str, checkpoint: dict[str, Any]) -> None:
    """The loss scale saved in the checkpoint is a finite positive number (resuming would restore it)."""
    section = checkpoint.get("amp_plugin")
    scaler = section.get("scaler") if isinstance(section, dict) else None
    if not isinstance(scaler, dict) or "scale" not in scaler:
        return
    scale = scaler["scale"]
    try:
        value = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: the loss scale saved in it is {value} "
            "(amp_plugin.scaler.scale), and a loss scale must be a finite number > 0. The file was damaged or "
            "edited: resume from another checkpoint of the run, or start a new run without ckpt_path."
        )


def _warn_unreachable_faults(fault: Any, max_steps: int) -> None:
    if fault is None or max_steps == -1:
        return
    for key, steps in fault.items():
        if key in ("param", "rank") or steps is None:
            continue
        late = [s for s in (steps if OmegaConf.is_list(steps) else [steps]) if isinstance(s, int) and s >= max_steps]
        if late:
            warnings.warn(
                f"fault.{key}={show(steps)}: step {late[0]} is at or past trainer.max_steps={max_steps} (the last "
                f"step is {max_steps - 1}), so it never happens.",
                UserWarning,
                stacklevel=2,
            )
