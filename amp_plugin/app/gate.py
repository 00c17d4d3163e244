"""``amp-gate``: does a precision preset train as well as a reference, on your recipe?

    amp-gate precision=bf16_lean --against bf16 --seeds 4 recipe=digits trainer.max_steps=300

Every other argument is a Hydra override, as ``train.py`` takes them. For each seed
``first_seed, ..., first_seed + seeds - 1`` the gate trains the reference (``--against``) and the
candidate (``precision=``) with ``seed=i`` and the same overrides, through the app's own
:func:`~amp_plugin.app.run.train`, one run after the other in this process. Then it prints, per
judged metric (:data:`~amp_plugin.app.gate_stats.DIRECTIONS`: ``val/loss``, and ``val/acc`` where
the recipe logs it), each side's mean, the paired difference with its standard error and the
verdict (:mod:`amp_plugin.app.gate_stats` defines them), the bytes of training state per parameter
of each side, and the skipped steps.

Exit status: 0 when the candidate is within noise of the reference or better; 1 when it is worse,
when a run failed or when the runs hold no judged metric; 2 on bad input (an unknown preset, fewer
than 2 seeds, an override the gate sets itself, a config that does not compose or is rejected),
before anything is trained.

Files, under ``--dir`` (default ``gate``)::

    <preset>/seed<i>/                 each run's directory (summary.json, logs/, ...)
    <preset>/seed<i>/gate_run.json    the run's composed config and its bytes per parameter
    gate-<A>-vs-<B>.json              the report (``--json`` elsewhere)

A run whose directory already holds a finished run of the same composed config is reused, not
trained again: gates of several candidates against one reference in one ``--dir`` train the
reference once. ``--fresh`` trains every run again. Unless the overrides say otherwise, the runs
use ``callbacks=none`` (no checkpoints), ``plot=false`` and no progress bar.

Bytes per parameter (:mod:`amp_plugin.app.state_bytes`, the accounting of
``benchmarks/bench_memory.py``): weights, masters and optimizer state counted from the tensors
the trained run holds; gradients as one per parameter in its dtype (Lightning frees them between
steps).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amp_plugin.app.gate_stats import DIRECTIONS, judge, overall
from amp_plugin.app.validation import ConfigError, forget_checkpoints

__all__ = ["GateInputError", "compose_run", "main", "run_gate"]

_OWN_KEYS = ("seed", "output_dir", "ckpt_path", "overwrite")  # the gate sets these per run
_DEFAULTS = {"callbacks": "none", "plot": "false", "trainer.enable_progress_bar": "false"}


class GateInputError(ValueError):
    """Bad input to the gate (exit status 2)."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="amp-gate",
        description="Train paired seeds of a precision preset and a reference; say whether it trains as well.",
        epilog="Other arguments are Hydra overrides, as train.py takes them (recipe=char_gpt trainer.max_steps=300).",
    )
    parser.add_argument("overrides", nargs="*", help="precision=PRESET (required) and other Hydra overrides")
    parser.add_argument("--against", required=True, help="the reference preset, e.g. bf16 (FP32 masters)")
    parser.add_argument("--seeds", type=int, default=4, help="paired seeds (>= 2; default 4)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--sigmas", type=float, default=2.0, help="noise band in standard errors (default 2)")
    parser.add_argument(
        "--tolerance", type=float, default=0.0, help="noise band relative to the reference's mean, if wider (0.03: 3%%)"
    )
    parser.add_argument("--dir", type=Path, default=Path("gate"), help="directory of the runs (default ./gate)")
    parser.add_argument("--json", type=Path, help="the report's path (default DIR/gate-A-vs-B.json)")
    parser.add_argument("--fresh", action="store_true", help="train every run again (no reuse of finished runs)")
    return parser.parse_intermixed_args(argv)


def check_args(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """``(candidate, reference, other overrides)``, or :class:`GateInputError` naming the argument."""
    from amp_plugin.settings import PRESETS

    allowed = ", ".join(sorted(PRESETS))
    given = [o for o in args.overrides if _key(o) == "precision"]
    if len(given) != 1 or "=" not in given[0]:
        raise GateInputError(
            f"precision=PRESET must be given once (got {len(given)}: {given}); allowed presets: {allowed}."
        )
    candidate = given[0].split("=", 1)[1]
    for name, value in (("precision", candidate), ("--against", args.against)):
        if value not in PRESETS:
            raise GateInputError(f"{name}={value!r} is not a preset; allowed: {allowed}.")
    if candidate == args.against:
        raise GateInputError(f"precision={candidate} and --against={args.against} are the same preset; compare two.")
    if args.seeds < 2:
        raise GateInputError(f"--seeds={args.seeds}: a standard error needs at least 2 paired seeds (allowed: >= 2).")
    if args.first_seed < 0:
        raise GateInputError(f"--first-seed={args.first_seed}: seeds are >= 0.")
    for name, value in (("--sigmas", args.sigmas), ("--tolerance", args.tolerance)):
        if not value >= 0:  # also NaN
            raise GateInputError(f"{name}={value}: allowed values are >= 0.")
    others = [o for o in args.overrides if _key(o) != "precision"]
    for override in others:
        key = _key(override)
        if key in _OWN_KEYS or key.startswith("hydra."):
            raise GateInputError(
                f"{override!r}: the gate sets {key} itself (seeds with --seeds/--first-seed, directories with --dir)."
            )
        if "=" not in override:
            raise GateInputError(f"{override!r} is not a Hydra override (KEY=VALUE).")
    return candidate, args.against, others


def compose_run(overrides: Sequence[str], preset: str, seed: int, output_dir: Path) -> Any:
    """The config of one run, composed as ``train.py`` composes it (same configs, same schemas).

    Raises:
        GateInputError: the overrides do not compose (Hydra's message, naming the key).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from amp_plugin.app.cli import CONFIG_NAME, config_dir
    from amp_plugin.app.schema import register_configs

    register_configs()
    keys = {_key(o) for o in overrides}
    defaults = [
        f"{k}={v}" for k, v in _DEFAULTS.items() if not any(key == k or key.startswith(k + ".") for key in keys)
    ]
    full = [*defaults, *overrides, f"precision={preset}", f"seed={seed}", f"output_dir={output_dir.resolve()}"]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose(CONFIG_NAME, overrides=full)
    except Exception as err:  # Hydra's override, missing-config and schema errors
        reason = " ".join(str(err).split())
        raise GateInputError(f"the overrides do not compose for precision={preset}: {reason}") from err


def check_config(cfg: Any, preset: str) -> None:
    """Every check a run makes before it trains: :func:`~amp_plugin.app.build.prepare` and
    :func:`~amp_plugin.app.build.build` (recipe, plugin, callbacks, Trainer), into a scratch directory.

    Raises:
        GateInputError: the config is rejected (the app's message, naming the key).
    """
    from amp_plugin.app.build import build, prepare

    with tempfile.TemporaryDirectory(prefix="amp-gate-check-") as scratch:
        try:
            build(cfg, prepare(cfg), Path(scratch))
        except ConfigError as err:
            raise GateInputError(f"precision={preset}: {err}") from err
        finally:
            forget_checkpoints()
            gc.collect()


def _bytes_per_param(result: dict[str, Any]) -> dict[str, Any]:
    from amp_plugin.app.state_bytes import COMPONENTS, gradient_bytes, tally

    module, trainer = result["module"], result["trainer"]
    counted = tally(module, trainer.optimizers)
    if counted["grads"] == 0:
        counted["grads"] = gradient_bytes(module)
    params = sum(p.numel() for p in module.parameters())
    per = {c: counted[c] / params for c in COMPONENTS}
    return {"params": params, **per, "total": sum(per.values())}


def _run_one(cfg: Any, out: Path, fresh: bool) -> dict[str, Any]:
    """Train (or reuse) one run; its summary plus ``bytes_per_param`` and ``reused``."""
    from omegaconf import OmegaConf

    from amp_plugin.app import reuse, rundir
    from amp_plugin.app.build import prepare
    from amp_plugin.app.run import train

    record_file, summary_file = out / "gate_run.json", out / "summary.json"
    config_text = OmegaConf.to_yaml(cfg)
    if not fresh and record_file.is_file() and summary_file.is_file():
        try:
            record, summary = json.loads(record_file.read_text()), json.loads(summary_file.read_text())
        except (OSError, ValueError):
            record, summary = {}, {}
        if record.get("config") == config_text and summary.get("status") == "ok":
            return {**summary, "bytes_per_param": record["bytes_per_param"], "reused": True}
    rundir.claim(out, "--dir")
    try:
        reuse.clear_outputs(out)
        record_file.unlink(missing_ok=True)
        result = train(cfg, prepare(cfg))
        per_param = _bytes_per_param(result)
    finally:
        rundir.release(out)
    summary = {k: v for k, v in result.items() if k not in ("trainer", "module", "plugin")}
    del result
    gc.collect()
    record_file.write_text(json.dumps({"config": config_text, "bytes_per_param": per_param}, indent=1) + "\n")
    return {**summary, "bytes_per_param": per_param, "reused": False}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _side(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    bpp = [r["bytes_per_param"] for r in runs]
    return {
        "bytes_per_param": {k: _mean([b[k] for b in bpp]) for k in bpp[0]},
        "skipped_steps": [r["skipped_steps"] for r in runs],
        "steps": [r["steps"] for r in runs],
        "wall_time_s": [r["wall_time_s"] for r in runs],
    }


def run_gate(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """Check, train, judge; returns ``(exit status, report)`` (the report is also written)."""
    import torch

    candidate, reference, overrides = check_args(args)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    directory: Path = args.dir
    plan = [(preset, seed) for seed in seeds for preset in (reference, candidate)]
    configs = {(p, s): compose_run(overrides, p, s, directory / p / f"seed{s}") for p, s in plan}
    for preset in (reference, candidate):
        check_config(configs[(preset, seeds[0])], preset)
    report: dict[str, Any] = {
        "command": "amp-gate " + shlex.join([*args.overrides, "--against", reference, "--seeds", str(args.seeds)]),
        "candidate": candidate,
        "reference": reference,
        "seeds": seeds,
        "sigmas": args.sigmas,
        "tolerance": args.tolerance,
        "overrides": overrides,
        "dir": str(directory),
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "runs": [],
    }
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for preset, seed in plan:
        out = directory / preset / f"seed{seed}"
        print(f"amp-gate: precision={preset} seed={seed} -> {out}", flush=True)
        try:
            run = _run_one(configs[(preset, seed)], out, args.fresh)
        except ConfigError as err:  # raised before the run trains
            raise GateInputError(f"precision={preset}: {err}") from err
        except Exception as err:
            message = " ".join(f"{type(err).__name__}: {err}".split())[:600]
            report["runs"].append({"preset": preset, "seed": seed, "dir": str(out), "status": "failed"})
            report.update(verdict="failed", exit_status=1, error=f"precision={preset} seed={seed} ({out}): {message}")
            return 1, report
        runs[(preset, seed)] = run
        report["runs"].append(
            {"preset": preset, "seed": seed, "dir": str(out), "status": run["status"], "reused": run["reused"]}
            | {k: run[k] for k in ("steps", "skipped_steps", "wall_time_s", "final_metrics", "bytes_per_param")}
        )
    report["sides"] = {p: _side([runs[(p, s)] for s in seeds]) for p in (candidate, reference)}
    finals = {p: [runs[(p, s)]["final_metrics"] for s in seeds] for p in (candidate, reference)}
    judged = [m for m in DIRECTIONS if all(m in f for side in finals.values() for f in side)]
    verdicts = [
        judge(m, [f[m] for f in finals[candidate]], [f[m] for f in finals[reference]], args.sigmas, args.tolerance)
        for m in judged
    ]
    report["metrics"] = [v.to_dict() for v in verdicts]
    if not verdicts:
        report.update(
            verdict="failed",
            exit_status=1,
            error=f"the runs hold none of the judged metrics ({', '.join(DIRECTIONS)}): does the recipe validate?",
        )
        return 1, report
    verdict = overall(verdicts)
    status = 1 if verdict == "worse" else 0
    report.update(verdict=verdict, exit_status=status)
    return status, report


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4g}" if value < 0 else f"{value:.4g}"


def format_report(report: dict[str, Any]) -> str:
    """The table ``amp-gate`` prints (see the module docstring)."""
    a, b = report["candidate"], report["reference"]
    lines = [
        "",
        f"amp-gate: precision={a} against {b}, {len(report['seeds'])} paired seeds {report['seeds']}",
        f"  overrides  {' '.join(report['overrides']) or '(none)'}",
        f"  noise band max({report['sigmas']:g} SE, {100 * report['tolerance']:g}% of {b}'s mean)",
    ]
    if report.get("metrics"):
        head = ["metric", f"{a} mean", f"{b} mean", "A-B", "SE", "band", "verdict"]
        rows = [
            [
                m["metric"],
                _fmt(m["mean_a"]),
                _fmt(m["mean_b"]),
                "-" if m["diff"] is None else f"{m['diff']:+.4g}",
                _fmt(m["se"]),
                _fmt(m["band"]),
                m["text"],
            ]
            for m in report["metrics"]
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines.append("")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    for name in (a, b):
        side = report.get("sides", {}).get(name)
        if side is None:
            continue
        bpp = side["bytes_per_param"]
        parts = ", ".join(f"{k} {bpp[k]:.2f}" for k in ("weights", "grads", "master", "master_grads", "moments"))
        lines.append(f"  {name}: {bpp['total']:.2f} bytes/param ({parts}); skipped steps {side['skipped_steps']}")
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    lines.append(f"verdict: {report['verdict']} (exit {report['exit_status']})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``amp-gate`` console script; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    try:
        status, report = run_gate(args)
    except GateInputError as err:
        print(f"amp-gate: error: {err}", file=sys.stderr, flush=True)
        return 2
    from amp_plugin.app.report import to_json

    path = args.json or args.dir / f"gate-{report['candidate']}-vs-{report['reference']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(report) + "\n")
    print(format_report(report) + f"\nwrote {path}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
