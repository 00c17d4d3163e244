"""Build a run from a composed config: every object from its config node, checked by its constructor.

Two phases, so that a mistake on the command line costs about a second:

1. :func:`prepare`, without importing Lightning: :func:`~amp_plugin.app.validation.validate`
   (cross-key and app-only checks), the loss scaler, and the
   :class:`~amp_plugin.settings.PrecisionSettings` that owns every precision rule.
2. :func:`build`, with Lightning: seed, recipe (with ``precision=fp8``, its ``keep_bf16`` patterns
   checked against the recipe's linear layers), plugin
   (:meth:`~amp_plugin.lightning.MixedPrecisionPlugin.from_settings`), callbacks, loggers, fault
   injector, trainer.

Each constructor checks its own arguments. :func:`construct` turns its ``ValueError`` or
``TypeError`` into a :class:`~amp_plugin.app.validation.ConfigError` that names the config key:
``growth_factor=0.5 is not allowed: ...`` from ``DynamicLossScaler`` becomes
``scaler.growth_factor=0.5 is not allowed: ...``. A key the constructor does not take is
rejected with the list of keys it does take.

Configs name ``lightning.pytorch.*`` classes; with ``pytorch_lightning`` as the app's Lightning
(:data:`amp_plugin.lightning.pl`), :func:`build` points them there (and the other way round).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from amp_plugin.app.config_nodes import entries, naming_key, plain
from amp_plugin.app.rundir import read_run_id
from amp_plugin.app.validation import ConfigError, process_count, show, validate
from amp_plugin.scaling import LossScaler
from amp_plugin.settings import PrecisionSettings

__all__ = ["Run", "build", "construct", "instantiate", "prepare", "resolve_output_dir", "retarget"]

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


# ---------------------------------------------------------------------------------- config node -> object
def construct(key: str, factory: Callable[..., Any], node: Any, **extra: Any) -> Any:
    """``factory(**node, **extra)``, with every rejection a :class:`ConfigError` naming ``key``.

    ``node`` (a config node or a dict; ``_target_`` is ignored) holds the arguments from the
    config; ``extra`` the ones the app adds, which replace a node key of the same name.
    Nested ``_target_`` nodes are instantiated first.
    """
    config = plain(node)
    config.pop("_target_", None)
    _check_keys(key, config, factory, extra)
    try:
        kwargs = hydra.utils.instantiate(config, _convert_="all")
        return factory(**{**kwargs, **extra})
    except ConfigError:
        raise
    except Exception as err:  # whatever a constructor raises about its input
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        raise ConfigError(naming_key(key, config, cause)) from err


def instantiate(key: str, node: Any, *, namespace: str | None = None, **extra: Any) -> Any:
    """Build the ``_target_`` of ``node`` with :func:`construct`.

    ``namespace`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``): the Lightning package
    that ``_target_`` paths naming the other one are moved to (:func:`retarget`).
    """
    if not (isinstance(node, dict) or OmegaConf.is_dict(node)) or "_target_" not in node:
        group = key.split(".")[0]
        raise ConfigError(
            f"{key}={show(node)} is not allowed: {key} must be a config with a _target_ naming the class to build "
            f"(see configs/{group}/)."
        )
    config = plain(node)
    if namespace is not None:
        config = retarget(config, namespace)
    target = config["_target_"]
    try:  # Hydra's own lookup, with its checks of what a config may name
        factory = hydra.utils.instantiate({"_target_": target, "_partial_": True}).func
    except InstantiationException as err:
        reason = " ".join(str(err.__cause__ or err).split())
        raise ConfigError(
            f"{key}._target_={target!r} is not allowed: it must name an importable class ({reason})."
        ) from err
    return construct(key, factory, config, **extra)


def retarget(config: Any, namespace: str) -> Any:
    """``config`` with every ``_target_`` under the other Lightning namespace moved to ``namespace``."""
    other = next(n for n in NAMESPACES if n != namespace)
    if isinstance(config, list):
        return [retarget(item, namespace) for item in config]
    if not isinstance(config, dict):
        return config
    moved = {k: retarget(v, namespace) for k, v in config.items()}
    target = moved.get("_target_")
    if isinstance(target, str) and target.startswith(other + "."):
        moved["_target_"] = namespace + target[len(other) :]
    return moved


def _check_keys(key: str, config: dict[str, Any], factory: Callable[..., Any], extra: dict[str, Any]) -> None:
    """Reject a key the constructor does not take (say ``+recipe.lrr=0.1``), listing those it does."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the call will tell
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in config if k not in names and not (k.startswith("_") and k.endswith("_"))]
    if unknown:
        allowed = ", ".join(n for n in names if n not in extra) or "none"  # the app sets the others
        raise ConfigError(
            f"{key}.{unknown[0]} is not a setting of {factory.__qualname__}: the allowed keys are {allowed}."
        )


# ---------------------------------------------------------------------------------- phase 1: no Lightning
def prepare(cfg: DictConfig) -> PrecisionSettings:
    """Validate ``cfg`` and build its loss scaler and precision settings, without importing Lightning.

    Raises:
        ConfigError: the first value that a check or a constructor rejects.
    """
    validate(cfg)
    return construct("precision", PrecisionSettings.build, cfg.precision, scaler=_scaler(cfg.scaler))


def _scaler(node: DictConfig) -> LossScaler | None:
    if "_target_" in node:
        return instantiate("scaler", node)
    if len(node):
        key: object = next(iter(node))  # a DictConfig key (str for a YAML config)
        raise ConfigError(
            f"scaler.{key} is not a setting of scaler=none: without loss scaling there is nothing "
            "to set. Pick a scaler first, e.g. scaler=dynamic."
        )
    return None  # scaler=none: PrecisionSettings gives the plugin a disabled scaler


# ---------------------------------------------------------------------------------- phase 2: Lightning
@dataclass
class Run:
    """What :func:`build` assembles: what ``trainer.fit`` needs and what the report reads.

    Attributes:
        trainer, module, plugin: the Lightning objects (``module`` is the recipe).
        callbacks: the configured callbacks (``cfg.callbacks``), without the two below.
        loggers: the configured loggers.
        recorder: the :class:`~amp_plugin.app.report.RunRecorder` behind the summary and plot.
        injector: the :class:`~amp_plugin.callbacks.FaultInjector`, or None without ``fault.*``.
        output_dir, ckpt_path, seed, plot: the run's directory and the app keys the report repeats.
        resume_step: the checkpoint's ``global_step`` when resuming, else None.
        resume_in_place: whether the checkpoint lies inside ``output_dir`` (the run continues its files).
        run_id: the id every checkpoint of the run carries (the directory's when resuming in place).
    """

    trainer: Any
    module: Any
    plugin: Any
    callbacks: list[Any]
    loggers: list[Any]
    recorder: Any
    injector: Any
    output_dir: Path
    ckpt_path: str | None
    seed: int
    plot: bool
    resume_step: int | None = None
    resume_in_place: bool = False
    run_id: str | None = None


def build(cfg: DictConfig, settings: PrecisionSettings | None = None, output_dir: Path | None = None) -> Run:
    """Build everything a run needs; nothing is written to disk.

    Args:
        cfg: the composed config.
        settings: :func:`prepare`'s result, when the caller already ran it (the CLI does, to
            fail before importing Lightning); otherwise :func:`prepare` runs here.
        output_dir: where the run writes; default :func:`resolve_output_dir`.

    Raises:
        ConfigError: the first value that a check or a constructor rejects.
    """
    if settings is None:
        settings = prepare(cfg)
    output_dir = output_dir or resolve_output_dir(cfg)
    # Lightning from here on.
    from amp_plugin.app.report import HISTORY_FILE, RunRecorder
    from amp_plugin.app.resume import ResumeSettings, check_fits, load_checkpoint, resumes_in_place
    from amp_plugin.app.watch import RunDirWatch
    from amp_plugin.lightning import AtomicCheckpointIO, FaultInjector, MixedPrecisionPlugin, pl
    from amp_plugin.lightning.callbacks.fp8 import FP8Monitor
    from amp_plugin.lightning.final_checkpoint import FinalCheckpoint
    from amp_plugin.lightning.interrupt import GracefulInterrupt
    from amp_plugin.lightning.nan_guard import NonFiniteGuard

    make = functools.partial(instantiate, namespace=pl.__name__)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)  # before the recipe initialises its weights
    module = make("recipe", cfg.recipe)
    if not isinstance(module, pl.LightningModule):
        raise ConfigError(
            f"recipe._target_={cfg.recipe._target_!r} is not allowed: it must be a "
            f"{pl.__name__}.LightningModule subclass."
        )
    _check_fp8_layers(module, settings, cfg.precision)
    resume_step = None
    if cfg.ckpt_path is not None:
        checkpoint = load_checkpoint(cfg.ckpt_path)
        check_fits(module, checkpoint, cfg.ckpt_path)
        resume_step = int(checkpoint.get("global_step", 0))
    plugin = MixedPrecisionPlugin.from_settings(settings)
    callbacks = [make(f"callbacks.{name}", node) for name, node in entries(cfg.callbacks)]
    if settings.fp8 is not None and callbacks and not any(isinstance(c, FP8Monitor) for c in callbacks):
        callbacks.append(FP8Monitor(every_n_steps=log_every_n_steps(cfg.trainer)))  # fp8: in the defaults
    in_place = resumes_in_place(cfg.ckpt_path, output_dir)
    loggers = [
        make(f"logger.{name}" if name else "logger", node, **_logger_extra(node, in_place, resume_step))
        for name, node in entries(cfg.logger)
    ]
    fault = cfg.get("fault") or {}
    injector = construct("fault", FaultInjector, fault) if any(v is not None for v in fault.values()) else None
    if injector is not None and injector.nan_input_at:
        _check_float_inputs(module, fault)
    _check_fractions(module, cfg.trainer)
    recorder = RunRecorder(history_path=output_dir / HISTORY_FILE, continue_history=in_place)
    run_id = (read_run_id(output_dir) if in_place else None) or uuid.uuid4().hex[:16]
    # The guard first: a non-finite step stops the run before any callback saves it. The
    # interrupt last: the step's rows are recorded before its checkpoint is written.
    own_first = [RunDirWatch(output_dir), NonFiniteGuard(), *([injector] if injector else [])]
    own_last = [FinalCheckpoint(), ResumeSettings(cfg, cfg.ckpt_path, run_id), recorder, GracefulInterrupt()]
    trainer = make(
        "trainer",
        cfg.trainer,
        plugins=[plugin, AtomicCheckpointIO()],
        callbacks=[*own_first, *callbacks, *own_last],
        logger=loggers or False,
        default_root_dir=str(output_dir),
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        log_every_n_steps=log_every_n_steps(cfg.trainer),
        **_strategy(cfg.trainer, pl),
    )
    if injector is not None:
        try:
            injector.setup(trainer, module, "fit")  # its checks of param and rank, before the first step
        except ValueError as err:
            raise ConfigError(naming_key("fault", plain(fault), err)) from err
    return Run(
        trainer=trainer,
        module=module,
        plugin=plugin,
        callbacks=callbacks,
        loggers=loggers,
        recorder=recorder,
        injector=injector,
        output_dir=output_dir,
        ckpt_path=cfg.ckpt_path,
        seed=cfg.seed,
        plot=cfg.plot,
        resume_step=resume_step,
        resume_in_place=in_place,
        run_id=run_id,
    )


def _strategy(trainer: DictConfig, pl: Any) -> dict[str, Any]:
    """``trainer.strategy=fsdp``: FSDP2 through Lightning's ``ModelParallelStrategy`` (every process
    data parallel, no tensor parallelism), with checkpoints gathered into one file that the app's
    resume and recovery read like any other. Other strategies go to the Trainer as they are."""
    if trainer.strategy != "fsdp":
        return {}
    processes = process_count(trainer)
    assert processes is not None  # validate() refused it
    return {
        "strategy": pl.strategies.ModelParallelStrategy(
            data_parallel_size=processes * trainer.num_nodes,
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
        )
    }


def _logger_extra(node: Any, in_place: bool, resume_step: int | None) -> dict[str, Any]:
    """TensorBoard resumed in place: ``purge_step`` hides the events the interrupted run logged after
    the checkpoint (the resumed run writes a new event file next to the old one)."""
    target = str(node.get("_target_", "")) if OmegaConf.is_dict(node) else ""
    if in_place and resume_step is not None and target.endswith("TensorBoardLogger") and "purge_step" not in node:
        return {"purge_step": resume_step}
    return {}


def _check_fp8_layers(module: Any, settings: PrecisionSettings, node: Any) -> None:
    """``precision.fp8.keep_bf16``: every pattern must match a linear layer of the recipe's model.

    The plugin converts the model inside ``trainer.fit`` (``convert_to_fp8``), after the run has taken
    its directory; the same check (:func:`amp_plugin.fp8.select.check_keep_bf16`) runs here on the built
    recipe, so that a typo is refused as a bad config before anything is written. A recipe that builds
    its linear layers later (in ``configure_model``) has none yet: ``convert_to_fp8`` checks it then.
    """
    if settings.fp8 is None or not settings.fp8.keep_bf16:
        return
    from amp_plugin.fp8.select import candidates, check_keep_bf16

    if not candidates(module):
        return
    try:
        check_keep_bf16(module, settings.fp8)
    except ValueError as err:
        raise ConfigError(naming_key("precision", plain(node), err)) from err


def _check_float_inputs(module: Any, fault: Any) -> None:
    """``fault.nan_input_at`` writes a NaN into the batch's first float tensor: the recipe must have one."""
    import torch

    from amp_plugin.lightning.callbacks.fault_injection import first_floating

    try:
        batch = next(iter(module.train_dataloader()))
    except Exception:  # the recipe needs its trainer to build data: the injector says it at the step
        return
    if first_floating(batch) is None:
        dtypes = sorted({str(t.dtype) for t in _tensors(batch, torch)})
        raise ConfigError(
            f"fault.nan_input_at={show(fault.nan_input_at)} is not allowed: recipe {type(module).__name__}'s "
            f"batches hold no floating-point tensor ({', '.join(dtypes) or 'no tensors'}), so there is no input to "
            "write a NaN into. Use fault.nan_loss_at or fault.inject_nan_at instead."
        )


def _check_fractions(module: Any, trainer: DictConfig) -> None:
    """A fraction ``limit_train_batches``/``limit_val_batches`` must leave at least one batch of the recipe's
    data (Lightning raises a traceback at the first epoch or validation otherwise)."""
    for key, loader in (("limit_train_batches", "train_dataloader"), ("limit_val_batches", "val_dataloader")):
        value = trainer.get(key)
        if not isinstance(value, float) or isinstance(value, bool) or not 0.0 < value < 1.0:
            continue
        try:
            batches = len(getattr(module, loader)())
        except Exception:  # no such loader, no length, or one that needs its trainer: Lightning checks it
            continue
        if batches > 0 and int(value * batches) < 1:
            raise ConfigError(
                f"trainer.{key}={show(value)} is not allowed: the recipe's {loader.split('_')[0]} data has {batches} "
                f"batches, and {show(value)} of them is less than one. Use a fraction >= {1 / batches:.4g}, a batch "
                "count (an integer >= 1), or null for all of it."
            )


def _tensors(batch: Any, torch: Any) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item, torch)]


def log_every_n_steps(trainer: DictConfig) -> int:
    """``trainer.log_every_n_steps``; when null, every step for runs of up to 100 steps, else every 10."""
    if trainer.log_every_n_steps is not None:
        return trainer.log_every_n_steps
    return 1 if 0 < trainer.max_steps <= 100 else 10


def resolve_output_dir(cfg: DictConfig) -> Path:
    """``cfg.output_dir``; outside a Hydra run (e.g. ``compose``) a fresh ``outputs/<date>/<time>``."""
    try:
        value = cfg.output_dir
    except Exception:  # ${hydra:...} without a running Hydra app
        value = None
    if not value:
        value = os.path.join("outputs", datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f"))
    return Path(value).absolute()
