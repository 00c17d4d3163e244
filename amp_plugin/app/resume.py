"""Resuming with ``ckpt_path=``: a checkpoint that fits, settings that take effect, logs that continue.

- :func:`load_checkpoint` (from :mod:`~amp_plugin.app.validation`): the checkpoint, read once
  for the checks and the build.
- :func:`check_fits`: a checkpoint of another recipe or model shape is refused before training,
  naming the keys or shapes that differ.
- :class:`ResumeSettings` (a callback ``train.py`` adds): what was changed on the command line
  since the checkpoint takes effect, with one log line per value. Optimizer settings
  (``recipe.lr``, ``recipe.weight_decay``, ``recipe.adam_eps``, ...) replace the ones in the
  checkpoint's optimizer state, and the LR schedule continues at the new rate. A new
  ``scaler.init_scale`` restarts the scale there. Every other recipe setting is built from the
  config anyway. Resuming from a recovery checkpoint (``last-good.ckpt``) restarts the loss
  scale at the configured ``init_scale``. A different optimizer is refused.
- :func:`keep_history`: resuming into the run's own directory keeps ``metrics.csv``'s rows up to
  the checkpoint's step; the rows of the interrupted part after it are dropped.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from amp_plugin.app.validation import ConfigError, forget_checkpoints, load_checkpoint, show
from amp_plugin.lightning.checkpoint_state import CHECKPOINT_KEY
from amp_plugin.lightning.namespace import Callback, rank_zero_info
from amp_plugin.lightning.recovery import is_recovery_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl
else:
    from amp_plugin.lightning import pl

__all__ = [
    "APP_KEY",
    "ResumeSettings",
    "check_fits",
    "forget_checkpoints",
    "keep_history",
    "load_checkpoint",
    "resumes_in_place",
]

APP_KEY = "amp_plugin_app"
"""Where a checkpoint written by ``train.py`` keeps the config sections it ran with."""
_SECTIONS = ("recipe", "precision", "scaler")


def resumes_in_place(ckpt_path: str | None, output_dir: Path) -> bool:
    """Whether ``ckpt_path`` lies inside ``output_dir`` (the run continues in its own directory)."""
    if ckpt_path is None:
        return False
    try:
        Path(os.path.realpath(ckpt_path)).relative_to(os.path.realpath(output_dir))
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------- does it fit?
def check_fits(module: Any, checkpoint: dict[str, Any], ckpt_path: str) -> None:
    """Refuse a checkpoint whose weights do not fit ``module`` (another recipe or model shape)."""
    saved = checkpoint.get("state_dict") or {}
    ours = module.state_dict()
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k not in ours]
    shapes = [
        f"{k} is {list(saved[k].shape)} there and {list(v.shape)} here"
        for k, v in ours.items()
        if k in saved and isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(v.shape)
    ]
    if not (missing or unexpected or shapes):
        return
    recipe = ((checkpoint.get(APP_KEY) or {}).get("config") or {}).get("recipe") or {}
    written_by = f" (written by recipe {recipe['_target_']})" if recipe.get("_target_") else ""
    details = []
    if missing:
        details.append(f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    if unexpected:
        details.append(f"unexpected {', '.join(unexpected[:3])}" + (" ..." if len(unexpected) > 3 else ""))
    details += shapes[:3]
    raise ConfigError(
        f"ckpt_path={ckpt_path!r} is not allowed: its weights do not fit recipe._target_="
        f"{type(module).__module__}.{type(module).__qualname__} with these settings{written_by}: "
        f"{'; '.join(details)}. Resume with the recipe and model settings the checkpoint was trained with "
        "(its run's .hydra/config.yaml), or start a new run without ckpt_path."
    )


# ---------------------------------------------------------------------------------- settings on resume
def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # betas: a tuple, or a list after FSDP2's load
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b) if not isinstance(a, torch.Tensor) else bool(torch.equal(a, torch.as_tensor(b)))
    except (RuntimeError, TypeError, ValueError):
        return False


def _as_number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


class ResumeSettings(Callback):
    """Make a resumed run use the settings it was started with (see the module docstring).

    Args:
        config: the run's config; its ``recipe``, ``precision`` and ``scaler`` sections go into
            every checkpoint under :data:`APP_KEY`, to compare with on a later resume.
        ckpt_path: the checkpoint this run resumes from, or None.
        run_id: the run's id (:mod:`amp_plugin.app.rundir`), saved in every checkpoint: resuming in
            place accepts only the run's own checkpoints.
    """

    def __init__(
        self, config: DictConfig | None = None, ckpt_path: str | None = None, run_id: str | None = None
    ) -> None:
        self.sections = _sections(config)
        self.ckpt_path = ckpt_path
        self.run_id = run_id
        self.lines: list[str] = []  # what was changed, as logged
        self._checkpoint: dict[str, Any] | None = None
        self._applied = False

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.sections or self.run_id:
            checkpoint[APP_KEY] = {"version": 1, "config": self.sections, "run_id": self.run_id}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._checkpoint, self._applied = checkpoint, False
        self._restart_scale(trainer, checkpoint)
        if trainer.optimizers:  # strategies that restore after setup: the optimizers exist already
            self._apply(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._checkpoint is not None and not self._applied:
            self._apply(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._checkpoint = None  # restored: let it go

    def _log(self, line: str) -> None:
        self.lines.append(line)
        rank_zero_info(f"amp_plugin: resume: {line}")

    # -------------------------------------------------------------- the loss scale
    def _restart_scale(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("scaler")
        if scaler is None or not scaler.is_enabled() or not saved or "scale" not in saved:
            return
        if (checkpoint.get(CHECKPOINT_KEY) or {}).get("scaler_type") != type(scaler).__name__:
            return  # another scaler type: the plugin does not reuse the saved state
        configured = scaler.get_scale()  # not restored yet: the configured init_scale
        old_init = (((checkpoint.get(APP_KEY) or {}).get("config") or {}).get("scaler") or {}).get("init_scale")
        new_init = (self.sections.get("scaler") or {}).get("init_scale")
        was = "" if _same(saved["scale"], configured) else f" (it was {saved['scale']:g} there)"
        if is_recovery_checkpoint(checkpoint, self.ckpt_path):
            why = (
                f"{self.ckpt_path} is a recovery checkpoint, so the loss scale restarts at scaler.init_scale="
                f"{configured:g}{was}"
            )
        elif old_init is not None and new_init is not None and not _same(old_init, new_init):
            why = (
                f"scaler.init_scale={show(new_init)} (the checkpoint's run started at {show(old_init)}): the "
                f"loss scale restarts at {configured:g}{was}"
            )
        else:
            return
        checkpoint[CHECKPOINT_KEY]["scaler"] = scaler.restarted(saved)
        self._log(why)

    # -------------------------------------------------------------- recipe settings
    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._applied = True
        checkpoint = self._checkpoint or {}
        old_hp = dict(checkpoint.get("hyper_parameters") or {})
        new_hp = dict(getattr(pl_module, "hparams", {}) or {})
        changed = {k: (old_hp[k], new_hp[k]) for k in new_hp if k in old_hp and not _same(old_hp[k], new_hp[k])}
        applied = self._apply_optimizers(trainer, checkpoint, changed)
        for name, (old, new) in changed.items():
            if name not in applied:
                self._log(
                    f"recipe.{name}={show(new)} (the checkpoint's run had {show(old)}): takes effect, as it "
                    "is built from the config, not restored from the checkpoint"
                )

    def _mismatch(self, changed: dict[str, tuple[Any, Any]], keys: set[str]) -> str:
        return _mismatch_text(self.ckpt_path, changed, keys)

    def _apply_optimizers(
        self, trainer: pl.Trainer, checkpoint: dict[str, Any], changed: dict[str, tuple[Any, Any]]
    ) -> set[str]:
        """Put the configured optimizer settings into the checkpoint's optimizer and scheduler states."""
        applied: set[str] = set()
        states = checkpoint.get("optimizer_states") or []
        for optimizer, state in zip(trainer.optimizers, states):
            saved_groups = state.get("param_groups") or []
            if len(saved_groups) != len(optimizer.param_groups):
                continue  # Lightning's load names this mismatch
            for saved, fresh in zip(saved_groups, optimizer.param_groups):
                keys, fresh_keys = set(saved) - {"params"}, set(fresh) - {"params"}
                if keys != fresh_keys:
                    raise ConfigError(self._mismatch(changed, keys ^ fresh_keys))
                base = "initial_lr" if "initial_lr" in fresh else "lr"
                for key in sorted((fresh_keys - {"lr", "initial_lr"}) | {base}):
                    old, new = _as_number(saved[key]), _as_number(fresh[key])
                    if _same(old, new):
                        continue
                    if base == "initial_lr" and key == base and old:
                        saved["lr"] = _as_number(saved["lr"]) * new / old  # the schedule continues at the new rate
                    saved[key] = fresh[key]
                    name = next((n for n, (a, b) in changed.items() if _same(a, old) and _same(b, new)), None)
                    label = f"recipe.{name}" if name else f"the optimizer's {key}"
                    if name is None or name not in applied:
                        self._log(
                            f"{label}={show(new)} (the checkpoint's run had {show(old)}): applied to the "
                            "optimizer" + (" and its LR schedule" if key == base else "")
                        )
                    if name:
                        applied.add(name)
        schedulers = checkpoint.get("lr_schedulers") or []
        for config, saved in zip(trainer.lr_scheduler_configs, schedulers):
            new_base = list(getattr(config.scheduler, "base_lrs", []))
            old_base = list(saved.get("base_lrs") or [])
            if "base_lrs" in saved and len(new_base) == len(old_base) and not _same(old_base, new_base):
                if "_last_lr" in saved and len(saved["_last_lr"]) == len(new_base):
                    saved["_last_lr"] = [
                        last * new / old if old else last
                        for last, new, old in zip(saved["_last_lr"], new_base, saved["base_lrs"])
                    ]
                saved["base_lrs"] = new_base
        return applied


def _mismatch_text(ckpt_path: str | None, changed: dict[str, tuple[Any, Any]], keys: set[str]) -> str:
    names = (
        ", ".join(f"recipe.{k}={show(new)} (the checkpoint's run had {show(old)})" for k, (old, new) in changed.items())
        or "this recipe"
    )
    if keys == {"initial_lr"}:
        why = "one of the two runs has an LR scheduler and the other has none"
    else:
        why = f"the checkpoint's optimizer has other settings ({', '.join(sorted(keys))}): it is another optimizer"
    return (
        f"ckpt_path={ckpt_path!r} cannot be resumed with {names}: {why}. Resume with the settings the checkpoint "
        "was trained with, or start a new run without ckpt_path."
    )


def _sections(config: DictConfig | None) -> dict[str, Any]:
    if config is None:
        return {}
    out = {}
    for key in _SECTIONS:
        if key in config and config[key] is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[key] = OmegaConf.to_container(config[key], resolve=True, enum_to_str=True)
    return out


# ---------------------------------------------------------------------------------- logs of a resumed run
def keep_history(loggers: list[Any], step: int, recorder: Any = None) -> None:
    """Before resuming in place: keep what the interrupted run logged up to the checkpoint's ``step``.

    Lightning's CSV logger deletes ``metrics.csv`` when it starts. Its rows logged before the
    checkpoint (Lightning logs step ``s`` for the ``s+1``-th optimizer step, so ``s < step``) are
    written back, with their header, and the resumed run appends to them; the rows of the
    interrupted part after the checkpoint are dropped. ``training_curves.csv`` rows up to
    ``step`` (a validation right after the checkpoint, which the resumed run does not repeat)
    go to ``recorder.kept``. Only the writing process (global rank 0) should call this.
    """
    if recorder is not None and recorder.history_path is not None and recorder.history_path.is_file():
        from amp_plugin.app.plots import read_history

        try:
            recorder.kept = {
                int(r["step"]): {k: v for k, v in r.items() if k != "step" and not math.isnan(v)}
                for r in read_history(recorder.history_path)
                if r["step"] <= step
            }
        except (ValueError, OSError):
            recorder.kept = {}
    for logger in loggers:
        if not isinstance(logger, pl.loggers.CSVLogger):
            continue
        path = Path(logger.log_dir) / "metrics.csv"
        rows = _rows_before(path, step) if path.is_file() else []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*exists and is not empty.*")
            writer = logger.experiment  # starting it deletes metrics.csv (rank 0; a no-op elsewhere)
        if not rows or not hasattr(writer, "metrics_keys"):
            continue
        keys = sorted({k for row in rows for k in row if k is not None})
        with path.open("w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            out.writeheader()
            out.writerows(rows)
        writer.metrics_keys = keys


UNREADABLE_METRICS = "metrics.csv.unreadable"
"""Where :func:`keep_history` keeps a ``metrics.csv`` it cannot read (Lightning's logger would delete it)."""


def _rows_before(path: Path, step: int) -> list[dict[str, str]]:
    """The rows of ``metrics.csv`` before ``step``. A file that is not CSV text (damaged: other bytes, a
    field beyond the csv module's limit) is kept beside as :data:`UNREADABLE_METRICS`, with a warning on
    stderr, and the resumed run's ``metrics.csv`` starts at the checkpoint: the logs are not worth stopping
    a resume for, nor losing."""
    try:
        with path.open(newline="") as f:
            return [r for r in csv.DictReader(f) if (s := _step(r)) is not None and s < step]
    except (ValueError, csv.Error) as err:  # UnicodeDecodeError is a ValueError
        kept = path.with_name(UNREADABLE_METRICS)
        os.replace(path, kept)
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        print(
            f"amp: {path} could not be read ({reason}): kept as {kept}; the resumed run's metrics.csv starts "
            f"at step {step}.",
            file=sys.stderr,
            flush=True,
        )
        return []


def _step(row: dict[str, str]) -> int | None:
    try:
        value = float(row.get("step") or "nan")
    except ValueError:
        return None
    return int(value) if math.isfinite(value) else None
