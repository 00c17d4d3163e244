"""``train(cfg)``: build a run from a composed config, fit it, and report what happened.

The order matters for bad input: everything that can reject the config (the schema checks,
the checkpoint, the recipe, scaler, plugin, callback, logger and trainer constructors) runs
before ``trainer.fit``, so a mistake ends the run before a checkpoint or a metric is
written. Such a mistake is a :class:`~amp_plugin.app.validation.ConfigError`; the run directory
then holds a ``FAILED`` file with the message, never a ``summary.json``.

Files of a run (``cfg.output_dir``, the Hydra run directory; see also
:mod:`amp_plugin.app.report`)::

    logs/metrics.csv          per-step metrics (CSV logger; TensorBoard event files with logger=tensorboard)
    logs/scale_events.csv     every loss-scale change (LossScaleMonitor)
    checkpoints/last.ckpt     resume with ckpt_path=... (written atomically: AtomicCheckpointIO)
    checkpoints/last-good.ckpt  the state before a loss-scale collapse stopped the run
    training_curves.csv       loss, loss scale, skipped steps and LR per step, validation metrics
    training_curves.png       the same, plotted
    summary.json              what train() returns, minus the live objects
    FAILED                    instead of summary.json: the error that stopped the run
"""

from __future__ import annotations

import collections.abc
import datetime
import inspect
import os
import time
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from amp_plugin.app.report import (
    FAILED_FILE,
    RunRecorder,
    mark_failed,
    summarize,
    write_outputs,
    format_summary,
)
from amp_plugin.app.schema import FAULT_STEP_KEYS
from amp_plugin.app.validation import ConfigError, scaler_kind, validate
from amp_plugin.lightning import AtomicCheckpointIO, FaultInjector, pl

MisconfigurationException = pl.utilities.exceptions.MisconfigurationException

__all__ = ["build", "train"]


# ---------------------------------------------------------------------------------- building
def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _instantiate(key: str, node: Any, **extra: Any) -> Any:
    """``hydra.utils.instantiate`` whose failures become a ConfigError naming ``key``."""
    try:
        return hydra.utils.instantiate(node, _convert_="all", **extra)
    except InstantiationException as err:
        cause = err.__cause__ or err
        target = node.get("_target_") if OmegaConf.is_dict(node) else None
        if isinstance(cause, (ImportError, AttributeError)) and "Error locating target" in str(err):
            raise ConfigError(
                f"{key}._target_={target!r} is not allowed: it must name an importable class "
                f"({str(err).splitlines()[0]})."
            ) from err
        raise ConfigError(f"{key} ({target}): {_message(cause)}") from err
    except (ValueError, TypeError, MisconfigurationException) as err:
        raise ConfigError(f"{key}: {_message(err)}") from err


def _message(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if text else type(err).__name__


def _check_recipe_types(node: DictConfig) -> None:
    """Check recipe keys and value types against the recipe class's ``__init__`` annotations."""
    target = node._target_
    try:
        cls = hydra.utils.get_class(target)
    except Exception as err:  # hydra raises ValueError/ImportError depending on what is missing
        raise ConfigError(
            f"recipe._target_={target!r} is not allowed: it must name an importable LightningModule "
            f"class ({_message(err)})."
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise ConfigError(f"recipe._target_={target!r} is not allowed: it must be a LightningModule subclass.")
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: the constructor will check
        hints = {}
    params = inspect.signature(cls.__init__).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key, value in _container(node).items():
        if key.startswith("_") and key.endswith("_"):
            continue
        if key not in params and not takes_kwargs:
            allowed = ", ".join(p for p in params if p != "self" and params[p].kind is not params[p].VAR_POSITIONAL)
            raise ConfigError(f"recipe.{key} is not a setting of {cls.__name__}: the allowed keys are {allowed}.")
        hint = hints.get(key)
        if hint is not None and not _matches(value, hint):
            raise ConfigError(
                f"recipe.{key}={value!r} is not allowed: {cls.__name__} takes {key} as {_type_name(hint)}."
            )


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args else Any
        return all(_matches(v, item) for v in value) if item is not Ellipsis else True
    return True  # anything richer: the constructor checks it


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}.get(
            hint.__name__, hint.__name__)
    return str(hint).replace("typing.", "").replace("collections.abc.", "")


def _check_checkpoint(path: str, max_steps: int) -> None:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        reason = _message(err).split(". ")[0][:200]  # torch's zip errors go on for several sentences
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: the file cannot be read as a checkpoint "
            f"({type(err).__name__}: {reason}); it is truncated, corrupt or not a checkpoint. ckpt_path must be "
            "a .ckpt file written by an earlier run (e.g. its checkpoints/last.ckpt)."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: it is not a Lightning checkpoint (no state_dict). "
            "ckpt_path must be a .ckpt file written by an earlier run (e.g. its checkpoints/last.ckpt)."
        )
    step = int(checkpoint.get("global_step", 0))
    if max_steps != -1 and step >= max_steps:
        raise ConfigError(
            f"trainer.max_steps={max_steps} leaves nothing to train: ckpt_path={path!r} is already at step "
            f"{step}. Set trainer.max_steps above {step} to continue the run."
        )


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate recipe, scaler, plugin, callbacks and loggers; nothing touches disk.

    Returns a dict with ``module``, ``plugin``, ``callbacks`` (list) and ``loggers`` (list).
    Raises :class:`ConfigError` if any constructor rejects its arguments.
    """
    validate(cfg)
    _check_recipe_types(cfg.recipe)
    module = _instantiate("recipe", cfg.recipe)
    scaler = None if scaler_kind(cfg.scaler) == "none" else _instantiate("scaler", cfg.scaler)
    precision = _container(cfg.precision)
    precision.pop("name", None)
    plugin = _instantiate("precision", precision, scaler=scaler)
    callbacks = [_instantiate(f"callbacks.{name}", node) for name, node in _entries(cfg.callbacks)]
    injector = _fault_injector(cfg.get("fault"), module)
    if injector is not None:
        callbacks.insert(0, injector)
    loggers = [_instantiate(f"logger.{name}" if name else "logger", node) for name, node in _entries(cfg.logger)]
    return {"module": module, "plugin": plugin, "callbacks": callbacks, "loggers": loggers}


def _fault_injector(node: Any, module: pl.LightningModule) -> FaultInjector | None:
    """A :class:`FaultInjector` from ``cfg.fault``, or None when no fault step is set."""
    fault = _container(node) or {}
    if all(fault.get(key) is None for key in FAULT_STEP_KEYS):
        return None
    param = fault.get("param")
    if param is not None:
        names = [name for name, p in module.named_parameters() if p.requires_grad]
        if param not in names:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ConfigError(
                f"fault.param={param!r} is not allowed: fault.param must name a trainable parameter of "
                f"{type(module).__name__} ({shown}), or be null for the first one with a gradient."
            )
    try:
        return FaultInjector(**fault)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"fault: {_message(err)}") from err


def _check_fault_rank(cfg: DictConfig, trainer: pl.Trainer) -> None:
    rank = cfg.fault.rank if cfg.get("fault") is not None else None
    if rank is not None and rank >= trainer.world_size:
        raise ConfigError(
            f"fault.rank={rank} is not allowed: this run has {trainer.world_size} process(es), so fault.rank "
            f"must be in [0, {trainer.world_size - 1}] (or null for every rank). More processes: "
            "trainer.devices=N trainer.strategy=ddp."
        )


def _entries(node: Any) -> list[tuple[str, Any]]:
    """A group's nodes to instantiate: one ``_target_`` node, or a dict of them by name (nulls dropped)."""
    if node is None:
        return []
    if "_target_" in node:
        return [("", node)]
    return [(name, entry) for name, entry in node.items() if entry is not None]


def _trainer(cfg: DictConfig, parts: dict[str, Any], recorder: RunRecorder, output_dir: Path) -> pl.Trainer:
    kwargs = _container(cfg.trainer)
    kwargs.pop("_target_", None)
    target = cfg.trainer._target_
    kwargs.update(
        plugins=[parts["plugin"], AtomicCheckpointIO()],
        callbacks=[*parts["callbacks"], recorder],
        logger=parts["loggers"] or False,
        default_root_dir=str(output_dir),
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in parts["callbacks"]),
    )
    try:
        return hydra.utils.get_class(target)(**kwargs)
    except (ValueError, TypeError, MisconfigurationException) as err:
        raise ConfigError(f"trainer: {_message(err)}") from err


# ---------------------------------------------------------------------------------- train


def resolve_output_dir(cfg: DictConfig) -> Path:
    """``cfg.output_dir``; outside a Hydra run (e.g. ``compose``) a fresh ``outputs/<date>/<time>``."""
    try:
        value = cfg.output_dir
    except Exception:  # ${hydra:...} without a running Hydra app
        value = None
    if not value:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")
        value = os.path.join("outputs", stamp)
    return Path(value).absolute()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Validate ``cfg``, train, write the plot and ``summary.json``, print the summary.

    Returns:
        The summary (JSON-friendly: ``final_metrics``, ``loss_scale``, ``skipped_steps``,
        ``steps``, ``wall_time_s``, ``paths``, ...) plus the live ``trainer``, ``module`` and
        ``plugin`` objects.

    Raises:
        ConfigError: a bad value, before anything is trained or written (apart from ``FAILED``).
    """
    output_dir = resolve_output_dir(cfg)
    try:
        validate(cfg)
        if cfg.ckpt_path is not None:
            _check_checkpoint(cfg.ckpt_path, cfg.trainer.max_steps)
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        parts = build(cfg)
        recorder = RunRecorder()
        trainer = _trainer(cfg, parts, recorder, output_dir)
        _check_fault_rank(cfg, trainer)
    except ConfigError as err:
        mark_failed(output_dir, err)
        raise
    threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    try:
        with warnings.catch_warnings():
            # The recipes keep their data in memory; worker processes would only add start-up time.
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            start = time.perf_counter()
            trainer.fit(parts["module"], ckpt_path=cfg.ckpt_path)
            wall = time.perf_counter() - start
            metrics = dict(trainer.callback_metrics)  # trainer.validate() below drops the train/* entries
            _final_validation(trainer, parts["module"], recorder)
            metrics.update(trainer.callback_metrics)
    except BaseException as err:
        mark_failed(output_dir, err)
        raise
    finally:
        torch.set_num_threads(threads)
    summary = summarize(cfg, trainer, parts, recorder, output_dir, wall, metrics)
    if trainer.is_global_zero:
        (output_dir / FAILED_FILE).unlink(missing_ok=True)  # a stale note from an earlier attempt here
        write_outputs(cfg, summary, recorder, output_dir)
        print(format_summary(summary), flush=True)
    return {**summary, "trainer": trainer, "module": parts["module"], "plugin": parts["plugin"]}


def _final_validation(trainer: pl.Trainer, module: pl.LightningModule, recorder: RunRecorder) -> None:
    """Validate the final weights unless the last validation already ran at the last step.

    ``max_steps`` usually ends a run mid-epoch, after the last scheduled validation; the
    summary and ``compare`` should report metrics of the weights the run ends with.
    """
    has_val = type(module).validation_step is not pl.LightningModule.validation_step
    limit = trainer.limit_val_batches
    if not has_val or limit == 0 or trainer.interrupted or trainer.global_step == recorder.start_step:
        return
    last_val = max((step for step, row in recorder.rows.items() if any(k.startswith("val/") for k in row)),
                   default=None)
    if last_val != trainer.global_step:
        trainer.validate(module, verbose=False)


