"""``train(cfg)``: build a run from a composed config, fit it, and report what happened.

The order matters for bad input: everything that can reject the config (the schema checks,
the checkpoint, the recipe, scaler, plugin, callback, logger and trainer constructors) runs
before ``trainer.fit``, so a mistake ends the run before a checkpoint or a metric is
written. Such a mistake is a :class:`~amp_plugin.app.schema.ConfigError`; the run directory
then holds a ``FAILED`` file with the message, never a ``summary.json``.

Files of a run (``cfg.output_dir``, the Hydra run directory)::

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
import json
import math
import os
import time
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import pytorch_lightning as pl
import torch
from hydra.errors import InstantiationException
from lightning_fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from amp_plugin.app import plots
from amp_plugin.app.checkpoint_io import AtomicCheckpointIO
from amp_plugin.app.schema import FAULT_STEP_KEYS, ConfigError, scaler_kind, validate
from amp_plugin.callbacks import FaultInjector

__all__ = ["RunRecorder", "build", "describe", "format_summary", "train"]

HISTORY_FILE = "training_curves.csv"
PLOT_FILE = "training_curves.png"
SUMMARY_FILE = "summary.json"
FAILED_FILE = "FAILED"


# ---------------------------------------------------------------------------------- recorder
class RunRecorder(Callback):
    """Records loss, loss scale, skipped steps and LR after every training step.

    Reads the plugin's public state (``plugin.scaler``), so the summary and the plot work
    with any logger and without the monitoring callbacks.
    """

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}
        self.start_scale: float | None = None
        self.start_step = 0
        self.start_skipped = 0

    @staticmethod
    def _scaler(trainer: pl.Trainer) -> Any:
        return getattr(trainer.precision_plugin, "scaler", None)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After a resume the checkpoint's scale and counters are already restored here.
        scaler = self._scaler(trainer)
        self.start_scale = scaler.get_scale() if scaler is not None else None
        self.start_skipped = scaler.skipped_steps if scaler is not None else 0
        self.start_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        scaler = self._scaler(trainer)
        loss = trainer.callback_metrics.get("train/loss")
        if loss is None and isinstance(outputs, Mapping):
            loss = outputs.get("loss")
        row = self.rows.setdefault(trainer.global_step, {})
        row["train_loss"] = _as_float(loss)
        row["loss_scale"] = scaler.get_scale() if scaler is not None else math.nan
        row["skipped_steps"] = float(scaler.skipped_steps) if scaler is not None else 0.0
        optimizers = trainer.optimizers
        row["lr"] = float(optimizers[0].param_groups[0]["lr"]) if optimizers else math.nan

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        row = self.rows.setdefault(trainer.global_step, {})
        for key, value in trainer.callback_metrics.items():
            if key.startswith("val/"):
                row[key] = _as_float(value)

    def history(self) -> list[dict[str, float]]:
        """One dict per step (``step`` first), sorted by step."""
        return [{"step": float(step), **row} for step, row in sorted(self.rows.items())]


def _as_float(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu())
    return float(value)


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
def describe(plugin: Any, scaler: str) -> str:
    """What a plugin does, in a few words: weights, compute, master copy, scaling, emulation."""
    dtype = str(plugin.amp_precision).upper()
    if plugin.amp_precision == "fp32":
        text = "FP32 weights and compute"
    elif plugin.master_weights:
        text = f"{dtype} weights and compute, FP32 master weights"
    elif plugin.autocast:
        text = f"FP32 weights, {dtype} compute under autocast"
    else:
        text = f"pure {dtype}, no FP32 master weights"
    s = getattr(plugin, "scaler", None)
    if s is None:
        text += ", no loss scaling"
    elif scaler == "static":
        text += f", static loss scale {s.get_scale():g}"
    else:
        text += f", {scaler} loss scaling"
    if getattr(plugin, "emulating", False):
        text += ", CPU half-precision emulation"
    return text


def _recipe_name(target: str) -> str:
    """``recipes.digits.DigitsRecipe`` -> ``digits`` (the module name, as in configs/recipe/)."""
    parts = target.split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


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
        _mark_failed(output_dir, err)
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
        _mark_failed(output_dir, err)
        raise
    finally:
        torch.set_num_threads(threads)
    summary = _summarize(cfg, trainer, parts, recorder, output_dir, wall, metrics)
    if trainer.is_global_zero:
        (output_dir / FAILED_FILE).unlink(missing_ok=True)  # a stale note from an earlier attempt here
        _write_outputs(cfg, summary, recorder, output_dir)
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


def _mark_failed(output_dir: Path, err: BaseException) -> None:
    """Leave a ``FAILED`` note in an existing run directory (Hydra creates it before the job)."""
    if output_dir.is_dir() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        (output_dir / FAILED_FILE).write_text(f"{type(err).__name__}: {err}\n")


def _summarize(cfg: DictConfig, trainer: pl.Trainer, parts: dict[str, Any], recorder: RunRecorder,
               output_dir: Path, wall: float, metrics: Mapping[str, Any]) -> dict[str, Any]:
    plugin = parts["plugin"]
    scaler = getattr(plugin, "scaler", None)
    history = recorder.history()
    scales = [recorder.start_scale] + [row.get("loss_scale") for row in history]
    scales = [s for s in scales if s is not None and not math.isnan(s)]
    growths = sum(b > a for a, b in zip(scales, scales[1:]))
    backoffs = sum(b < a for a, b in zip(scales, scales[1:]))
    final = {k: _as_float(v) for k, v in sorted(metrics.items(), key=_metric_order)
             if isinstance(v, (int, float, torch.Tensor)) and _numel(v) == 1}
    steps = trainer.global_step - recorder.start_step
    log_dir = Path(trainer.log_dir) if trainer.log_dir else output_dir
    checkpoint_dir = output_dir / "checkpoints"
    for cb in parts["callbacks"]:
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.dirpath:
            checkpoint_dir = Path(cb.dirpath)
    last = checkpoint_dir / "last.ckpt"
    paths = {
        "output_dir": output_dir,
        "metrics": log_dir / "metrics.csv" if (log_dir / "metrics.csv").exists() else None,
        "log_dir": log_dir,
        "scale_events": log_dir / "scale_events.csv" if (log_dir / "scale_events.csv").exists() else None,
        "checkpoints": checkpoint_dir if checkpoint_dir.is_dir() else None,
        "last_checkpoint": last if last.exists() else None,
        "history": output_dir / HISTORY_FILE,
        "plot": output_dir / PLOT_FILE if cfg.plot else None,
        "summary": output_dir / SUMMARY_FILE,
    }
    target = cfg.recipe._target_
    injector = next((c for c in parts["callbacks"] if isinstance(c, FaultInjector)), None)
    return {
        "status": "ok",
        "recipe": _recipe_name(target),
        "recipe_target": target,
        "precision": cfg.precision.name,
        "plugin_settings": {
            "precision": plugin.amp_precision,
            "master_weights": plugin.master_weights,
            "autocast": plugin.autocast,
            "emulating": bool(getattr(plugin, "emulating", False)),
            "describe": describe(plugin, scaler_kind(cfg.scaler)),
        },
        "scaler": scaler_kind(cfg.scaler),
        "seed": cfg.seed,
        "resumed_from": cfg.ckpt_path,
        "steps": steps,
        "global_step": trainer.global_step,
        "wall_time_s": round(wall, 3),
        "final_metrics": final,
        "loss_scale": {
            "start": recorder.start_scale,
            "end": scaler.get_scale() if scaler is not None else None,
            "changes": growths + backoffs,
            "growths": growths,
            "backoffs": backoffs,
        },
        "skipped_steps": (scaler.skipped_steps - recorder.start_skipped) if scaler is not None else 0,
        "skipped_steps_total": scaler.skipped_steps if scaler is not None else 0,
        # (step, kind) of each fault written by this process (fault.* options; rank 0's view).
        "faults_injected": [[step, kind] for step, kind in injector.injected] if injector is not None else [],
        "output_dir": str(output_dir),
        "paths": {k: (str(v) if v is not None else None) for k, v in paths.items()},
    }


def _metric_order(item: tuple[str, Any]) -> tuple[int, str]:
    key = item[0]
    rank = 0 if key == "train/loss" else 1 if key.startswith("train/") else 2 if key == "val/loss" else 3
    return rank, key


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 1


def _write_outputs(cfg: DictConfig, summary: dict[str, Any], recorder: RunRecorder, output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    history = recorder.history()
    plots.write_history(history, output_dir / HISTORY_FILE)
    if cfg.plot:
        title = f"{summary['recipe']} | precision={summary['precision']} | scaler={summary['scaler']}"
        plots.plot_run(history, output_dir / PLOT_FILE, title=title)
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1e4 or (0 < abs(value) < 1e-3):
        return f"{value:.4g}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.4g}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-run summary printed by ``train.py``."""
    ls = summary["loss_scale"]
    if ls["start"] is None:
        scale = "none (no loss scaling)"
    else:
        kinds = []
        if ls["growths"]:
            kinds.append(f"{ls['growths']} growth" + ("s" if ls["growths"] != 1 else ""))
        if ls["backoffs"]:
            kinds.append(f"{ls['backoffs']} backoff" + ("s" if ls["backoffs"] != 1 else ""))
        scale = f"start {ls['start']:g}, end {ls['end']:g}, {ls['changes']} change" + (
            "s" if ls["changes"] != 1 else "") + (f" ({', '.join(kinds)})" if kinds else "")
    metrics = "  ".join(f"{k} {_fmt(v)}" for k, v in summary["final_metrics"].items()
                        if k.startswith(("train/loss", "val/")))
    steps, wall = summary["steps"], summary["wall_time_s"]
    resumed = f" (resumed at step {summary['global_step'] - steps})" if summary["resumed_from"] else ""
    out = Path(summary["output_dir"])
    paths = summary["paths"]

    def rel(key: str) -> str | None:
        value = paths.get(key)
        if value is None:
            return None
        path = Path(value)
        try:
            return str(path.relative_to(out)) + ("/" if path.is_dir() else "")
        except ValueError:
            return str(path)

    lines = [
        "",
        "amp_plugin run summary",
        f"  recipe       {summary['recipe']}",
        f"  precision    {summary['precision']}: {summary['plugin_settings']['describe']}",
        f"  steps        {steps}{resumed} in {wall:.1f} s ({steps / wall if wall > 0 else 0:.1f} steps/s)",
        f"  final        {metrics or '-'}",
        f"  loss scale   {scale}",
        f"  skipped      {summary['skipped_steps']} of {steps} steps",
    ]
    faults = summary.get("faults_injected") or []
    if faults:
        shown = ", ".join(f"{kind} at {step}" for step, kind in faults[:4]) + (", ..." if len(faults) > 4 else "")
        lines.append(f"  faults       {len(faults)} injected: {shown}")
    lines.append(f"  outputs      {out}")
    for label, key in (("metrics", "metrics"), ("scale log", "scale_events"), ("checkpoint", "last_checkpoint"),
                       ("plot", "plot"), ("summary", "summary")):
        shown = rel(key)
        if shown is not None:
            lines.append(f"    {label:<11}{shown}")
    if paths.get("metrics") is None and paths.get("log_dir"):
        lines.append(f"    {'logs':<11}{rel('log_dir')}")
    return "\n".join(lines)
