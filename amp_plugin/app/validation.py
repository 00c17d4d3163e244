"""The checks Hydra's schemas cannot express, run before Lightning is imported.

:func:`validate` checks ranges (``growth_factor > 1``), choices (``precision.emulate``), and
combinations that contradict each other (``precision=fp32 scaler=static``). Every failure is
a :class:`ConfigError` whose message names the key, repeats the value and says what is
allowed.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_plugin.app.schema import (
    PRESETS,
    DynamicScalerConf,
    FaultConf,
    NoScalerConf,
    PrecisionConf,
    StaticScalerConf,
)

__all__ = ["ConfigError", "scaler_kind", "validate"]


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which key, what it got and what is allowed."""


# ---------------------------------------------------------------------------------- schemas

def _preset_for(precision: str, master_weights: bool, autocast: bool) -> str | None:
    for name, spec in PRESETS.items():
        if spec == (precision, master_weights, autocast):
            return name
    return None


_PRECISIONS = ("fp16", "bf16", "fp32")
_EMULATE = ("auto", "on", "off")
_HYSTERESIS_RESETS = ("growth", "finite")
_ON_MIN_SCALE = ("raise", "skip")
_SCALER_TARGETS = {
    "amp_plugin.DynamicLossScaler": "dynamic",
    "amp_plugin.dynamic_scaler.DynamicLossScaler": "dynamic",
    "amp_plugin.StaticLossScaler": "static",
    "amp_plugin.scaler.StaticLossScaler": "static",
}


def scaler_kind(scaler: Any) -> str:
    """``"dynamic"``, ``"static"``, ``"none"`` or ``"custom"`` for a ``cfg.scaler`` node."""
    if scaler is None or "_target_" not in scaler:
        return "none"
    return _SCALER_TARGETS.get(scaler["_target_"], "custom")


# ---------------------------------------------------------------------------------- checks
def _show(value: Any) -> str:
    """A value as it would be written on the command line (``true``, ``65536``, ``'abc'``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


def _fail(key: str, value: Any, allowed: str, hint: str = "") -> ConfigError:
    return ConfigError(f"{key}={_show(value)} is not allowed: {key} must be {allowed}." + (f" {hint}" if hint else ""))


def _choice(key: str, value: Any, choices: tuple[str, ...], hint: str = "") -> None:
    if value not in choices:
        raise _fail(key, value, "one of " + ", ".join(choices), hint)


def _number(key: str, value: Any, *, gt: float | None = None, lt: float | None = None,
            ge: float | None = None, hint: str = "") -> float:
    bounds = [f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else "",
              f"< {lt:g}" if lt is not None else ""]
    allowed = " and ".join(b for b in bounds if b)
    allowed = "a finite number" + (f" {allowed}" if allowed else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(key, value, allowed, hint)
    ok = math.isfinite(value) and (gt is None or value > gt) and (ge is None or value >= ge)
    ok = ok and (lt is None or value < lt)
    if not ok:
        raise _fail(key, value, allowed, hint)
    return float(value)


def _integer(key: str, value: Any, *, ge: int, hint: str = "", allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    allowed = f"an integer >= {ge}" + (" (or null)" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, int) or value < ge:
        raise _fail(key, value, allowed, hint)


def _check_keys(group: str, node: DictConfig, schema: type, what: str) -> None:
    """Reject keys a ``+group.key=value`` override added to a schema-backed node."""
    allowed = [f.name for f in fields(schema)]
    extra = [k for k in node.keys() if k not in allowed]
    if extra:
        shown = ", ".join(a for a in allowed if a != "_target_") or "none"
        raise ConfigError(
            f"{group}.{extra[0]} is not a setting of {what}: the allowed keys are {shown}."
        )


def _check_precision(p: DictConfig) -> None:
    _check_keys("precision", p, PrecisionConf, "the precision group")
    _choice("precision.precision", p.precision, _PRECISIONS)
    _choice("precision.emulate", p.emulate, _EMULATE,
            "'auto' emulates half-precision matmuls on CPUs without native half units.")
    if p.precision == "fp32" and (p.master_weights or p.autocast):
        key = "master_weights" if p.master_weights else "autocast"
        raise ConfigError(
            f"precision.{key}=true is not allowed with precision.precision=fp32: FP32 training has no "
            "half-precision copy and nothing to autocast, so precision.master_weights and precision.autocast "
            "must be false. For half precision pick a preset: precision=fp16, bf16, fp16_autocast, "
            "bf16_autocast, fp16_pure or bf16_pure."
        )
    spec = PRESETS.get(p.name)
    if spec is not None:
        expected = dict(zip(("precision", "master_weights", "autocast"), spec))
        for key, want in expected.items():
            got = p[key]
            if got != want:
                fitting = _preset_for(*(p[k] for k in expected))
                same_dtype = [n for n, spec in PRESETS.items() if spec[0] == p.precision]
                hint = (f"For that combination use precision={fitting}." if fitting else
                        f"The {p.precision} presets are " + "; ".join(
                            f"precision={n} ({_describe_preset(n)})" for n in same_dtype) + ".")
                raise ConfigError(
                    f"precision.{key}={_show(got)} contradicts precision={p.name}, which means "
                    f"precision.{key}={_show(want)} ({_describe_preset(p.name)}). {hint}"
                )
    if p.precision != "fp32" and p.master_weights and p.autocast:
        raise ConfigError(
            "precision.master_weights=true and precision.autocast=true cannot be combined: autocast keeps "
            "FP32 weights, which already are the master copy. Use precision=fp16 or bf16 (half weights, "
            "FP32 masters) or precision=fp16_autocast or bf16_autocast (FP32 weights under autocast)."
        )


def _describe_preset(name: str) -> str:
    precision, master, autocast = PRESETS[name]
    if precision == "fp32":
        return "plain FP32 training"
    dtype = precision.upper()
    if master:
        return f"{dtype} weights and compute, FP32 master weights in the optimizer"
    if autocast:
        return f"FP32 weights, {dtype} compute under autocast"
    return f"pure {dtype}: weights, gradients and updates all in {dtype}, no FP32 copy"


def _check_scaler(s: Any, precision: str) -> None:
    kind = scaler_kind(s)
    if kind != "none" and precision == "fp32":
        raise ConfigError(
            f"scaler={kind} is not allowed with precision=fp32: FP32 gradients do not underflow, so "
            "there is nothing to scale. Use scaler=none (the fp32 default) or a half-precision preset "
            "such as precision=fp16."
        )
    schema = {"dynamic": DynamicScalerConf, "static": StaticScalerConf, "none": NoScalerConf}.get(kind)
    if schema is not None and s is not None:
        _check_keys("scaler", s, schema, f"scaler={kind}")
    if kind == "static":
        _number("scaler.scale", s.scale, gt=0, hint="It multiplies the loss before backward, typically 2**16.")
    elif kind == "dynamic":
        _number("scaler.init_scale", s.init_scale, gt=0)
        _number("scaler.growth_factor", s.growth_factor, gt=1,
                hint="It multiplies the scale after growth_interval clean steps (default 2.0).")
        _number("scaler.backoff_factor", s.backoff_factor, gt=0, lt=1,
                hint="It multiplies the scale after an overflow (default 0.5).")
        _integer("scaler.growth_interval", s.growth_interval, ge=1,
                 hint="It is the number of clean steps in a row before the scale grows (default 2000).")
        _integer("scaler.hysteresis", s.hysteresis, ge=1,
                 hint="It is the number of overflows tolerated before backing off; 1 backs off at once.")
        _choice("scaler.hysteresis_reset", s.hysteresis_reset, _HYSTERESIS_RESETS)
        _choice("scaler.on_min_scale", s.on_min_scale, _ON_MIN_SCALE)
        lo = _number("scaler.min_scale", s.min_scale, gt=0)
        hi = _number("scaler.max_scale", s.max_scale, gt=0)
        if lo > hi:
            raise ConfigError(
                f"scaler.min_scale={_show(lo)} is above scaler.max_scale={_show(hi)}: scaler.min_scale must "
                "be <= scaler.max_scale."
            )
        if not lo <= s.init_scale <= hi:
            raise _fail("scaler.init_scale", s.init_scale,
                        f"within [scaler.min_scale, scaler.max_scale] = [{_show(lo)}, {_show(hi)}]")


def _check_trainer(t: DictConfig) -> None:
    if "precision" in t and t.precision is not None:
        raise ConfigError(
            f"trainer.precision={_show(t.precision)} is not allowed: the precision comes from the precision "
            "group (precision=fp32|fp16|bf16|fp16_autocast|bf16_autocast|fp16_pure|bf16_pure); drop "
            "trainer.precision."
        )
    _integer("trainer.max_steps", t.max_steps, ge=-1, hint="-1 means no step limit.")
    _integer("trainer.max_epochs", t.max_epochs, ge=-1, allow_none=True, hint="-1 means no epoch limit.")
    _integer("trainer.num_nodes", t.num_nodes, ge=1)
    _integer("trainer.accumulate_grad_batches", t.accumulate_grad_batches, ge=1)
    _integer("trainer.log_every_n_steps", t.log_every_n_steps, ge=1, allow_none=True)
    _integer("trainer.check_val_every_n_epoch", t.check_val_every_n_epoch, ge=1, allow_none=True)
    _integer("trainer.num_sanity_val_steps", t.num_sanity_val_steps, ge=-1, allow_none=True)
    for key in ("limit_train_batches", "limit_val_batches", "val_check_interval"):
        value = t[key]
        if value is None:
            continue
        fraction = isinstance(value, float) and 0.0 <= value <= 1.0
        count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if not (fraction or count):
            raise _fail(f"trainer.{key}", value, "a fraction of the epoch in [0.0, 1.0] or a batch count >= 0")
    devices = t.devices
    ok = (isinstance(devices, int) and not isinstance(devices, bool) and (devices >= 1 or devices == -1)) or (
        devices == "auto") or (isinstance(devices, str) and devices.replace(",", "").isdigit()) or (
        OmegaConf.is_list(devices) and all(isinstance(d, int) for d in devices))
    if not ok:
        raise _fail("trainer.devices", devices, "a count >= 1, -1 (all), 'auto' or a list of device indices")
    if t.gradient_clip_val is not None:
        _number("trainer.gradient_clip_val", t.gradient_clip_val, ge=0)


def _check_nodes(cfg: DictConfig) -> None:
    recipe = cfg.recipe
    if not OmegaConf.is_dict(recipe) or "_target_" not in recipe:
        raise ConfigError(
            f"recipe={_short(recipe)} is not allowed: recipe must be a config with a _target_ naming a "
            "LightningModule class, such as recipe=digits (see configs/recipe/)."
        )
    for group in ("callbacks", "logger"):
        node = cfg[group]
        if node is None:
            continue
        if not OmegaConf.is_dict(node):
            raise _fail(group, _short(node), "a config from configs/" + group + "/ or null")
        entries = {group: node} if "_target_" in node else {f"{group}.{k}": v for k, v in node.items()}
        for key, entry in entries.items():
            if entry is not None and (not OmegaConf.is_dict(entry) or "_target_" not in entry):
                raise _fail(key, _short(entry), "a config with a _target_ (a class to instantiate) or null")


def _short(node: Any) -> Any:
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


def _check_fault(f: Any) -> None:
    if f is None:
        return
    if not OmegaConf.is_dict(f):
        raise _fail("fault", _short(f), "a set of fault-injection keys such as fault.inject_inf_at=[3,7]")
    _check_keys("fault", f, FaultConf, "fault injection (amp_plugin.callbacks.FaultInjector)")
    for key in ("inject_inf_at", "inject_nan_at", "nan_loss_at", "nan_input_at"):
        steps = f[key]
        if steps is None:
            continue
        if not OmegaConf.is_list(steps) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            raise ConfigError(
                f"fault.{key}={_show_list(steps)} is not allowed: fault.{key} must be a list of optimizer steps "
                f"(integers >= 0, trainer.global_step values), e.g. fault.{key}=[3,7]."
            )
    _integer("fault.inject_inf_from", f.inject_inf_from, ge=0, allow_none=True,
             hint="Every step from this one on gets an inf gradient (persistent overflow).")
    _integer("fault.rank", f.rank, ge=0, allow_none=True, hint="null injects on every rank.")
    if f.param is not None and (not isinstance(f.param, str) or not f.param):
        raise _fail("fault.param", f.param, "the name of a model parameter (e.g. net.1.weight) or null")


def _show_list(value: Any) -> str:
    items = _short(value)
    if isinstance(items, list):
        return "[" + ",".join(_show(v) for v in items) + "]"
    return _show(items)


def _check_ckpt_path(path: Any) -> None:
    if path is None:
        return
    if not isinstance(path, str) or not path:
        raise _fail("ckpt_path", path, "the path of a checkpoint file written by an earlier run")
    if not os.path.isfile(path):
        where = "a directory" if os.path.isdir(path) else "no such file"
        raise ConfigError(
            f"ckpt_path={path!r} is not allowed: {where}. ckpt_path must be a checkpoint file written by "
            "an earlier run, for example outputs/<date>/<time>/checkpoints/last.ckpt."
        )


def validate(cfg: DictConfig) -> None:
    """Check ranges, choices and combinations of a composed config; raise :class:`ConfigError`.

    Types and unknown keys were already checked by the schemas while Hydra composed ``cfg``;
    this covers the rest, without importing torch or Lightning, and without touching disk
    apart from checking that ``ckpt_path`` exists.
    """
    for key in ("precision", "scaler", "recipe", "trainer"):
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"{key} is missing: choose one with {key}=NAME (see configs/{key}/).")
    _check_precision(cfg.precision)
    _check_scaler(cfg.scaler, cfg.precision.precision)
    _check_trainer(cfg.trainer)
    _check_nodes(cfg)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2**32:
        raise _fail("seed", cfg.seed, "an integer in [0, 2**32 - 1]")
    _integer("num_threads", cfg.num_threads, ge=1, allow_none=True,
             hint="It sets torch.set_num_threads for the run; null keeps PyTorch's default.")
    _check_ckpt_path(cfg.ckpt_path)
    _check_fault(cfg.get("fault"))
