"""``amp-gate``: does a precision preset train as well as a reference, on your recipe?

    amp-gate precision=bf16_lean --against bf16 --seeds 4 recipe=digits trainer.max_steps=300

Every other argument is a Hydra override, as ``train.py`` takes them. For each seed
``first_seed, ..., first_seed + seeds - 1`` the gate trains the reference (``--against``) and the
candidate (``precision=``) with ``seed=i`` and the same overrides, through the app's own
:func:`~amp_plugin.app.run.train`, one run after the other in this process. Then it prints, per
judged metric (:data:`~amp_plugin.app.gate_stats.DIRECTIONS`: ``val/loss``, and ``val/acc`` where
the recipe logs it), each side's mean, the paired difference with its standard error and the
verdict (:mod:`amp_plugin.app.gate_stats` defines them), the bytes of training state per parameter
of each side, and the skipped steps. What the runs themselves print (Lightning, the run summaries,
warnings) goes to a log file beside the report, ``DIR/gate-<A>-vs-<B>.log``: the console gets one
line naming it, one line per seed and the report, 16 lines for 4 seeds.

A regime with power against BF16 Adam moments that cannot shrink (``exp_avg_sq`` rounded to nearest
at ``beta2=0.999``; ``char_gpt``'s ``beta2=0.95`` and 100-300 steps hide it)::

    amp-gate precision=bf16_lean precision.moments_rounding=nearest --against bf16 --seeds 4 \
        --tolerance 0.001 recipe=bert_grad_drop trainer.max_steps=400    # worse: exit 1
    amp-gate precision=bf16_lean --against bf16 --seeds 4 \
        --tolerance 0.001 recipe=bert_grad_drop trainer.max_steps=400    # within noise: exit 0

(``docs/quality_gate.md`` has the numbers; ``tests/app/test_gate_power.py`` runs both.)

Exit status: 0 when the candidate is within noise of the reference or better; 1 when it is worse,
when a run failed, when the runs hold no judged metric, or when the gate cannot decide (``undecided``:
every paired difference equal, so a standard error of 0, and no ``--tolerance``); 2 on bad input
(an unknown preset, fewer than 2 seeds, a ``--sigmas`` or ``--tolerance`` that is negative or not
finite, an override the gate sets itself, a config that does not compose or is rejected, a ``--json``
that is a directory), before anything is trained; ``128 + signal`` when SIGTERM, SIGINT or SIGHUP stopped
it (143, 130, 129; :func:`main`): one line on stderr, no report, the finished runs kept for the next gate.

Files, under ``--dir`` (default ``gate``)::

    <preset>/seed<i>/                 each run's directory (summary.json, logs/, ...)
    <preset>/seed<i>/gate_run.json    the run's composed config and its bytes per parameter
    gate-<A>-vs-<B>.json              the report (``--json`` elsewhere)
    gate-<A>-vs-<B>.log               the runs' output (named after the report's file)

A run whose directory already holds a finished run of the same composed config is reused, not
trained again (unless a ``FAILED`` note lies beside it or its ``summary.json`` is not the file the
run wrote, which the per-seed line then says): gates of several candidates against one reference in
one ``--dir`` train the reference once. Keys that do nothing for a run's preset do not count (:func:`reuse_key`:
``precision.moments_rounding`` where the moments are FP32), so the gates of ``bf16_lean`` with
either rounding share the ``bf16`` runs. ``--fresh`` trains every run again. Unless the overrides
say otherwise, the runs use ``callbacks=none`` (no checkpoints), ``plot=false`` and no progress bar.

Bytes per parameter (:mod:`amp_plugin.app.state_bytes`, the accounting of
``benchmarks/bench_memory.py``): weights, masters and optimizer state counted from the tensors
the trained run holds; gradients as one per parameter in its dtype (Lightning frees them between
steps).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import shlex
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from amp_plugin.app.gate_output import cpu_model, format_report, output_to
from amp_plugin.app.gate_progress import Progress, signals_held
from amp_plugin.app.gate_stats import DIRECTIONS, judge, overall
from amp_plugin.app.outcome import Terminated
from amp_plugin.app.rundir import FAILED_FILE
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
        if not (math.isfinite(value) and value >= 0):  # nan and inf too: an infinite band passes every run
            raise GateInputError(f"{name}={value}: allowed values are finite numbers >= 0 (not nan or inf).")
    if args.json is not None and args.json.is_dir():
        raise GateInputError(f"--json={args.json} is a directory: give the report's file name ({args.json}/gate.json).")
    if args.dir.exists() and not args.dir.is_dir():
        raise GateInputError(f"--dir={args.dir} is a file: give a directory for the runs (created if missing).")
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


def quote(path: Path | str) -> str:
    """``path`` as a quoted Hydra override value: spaces, ``~``, ``=`` and commas are then plain characters."""
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


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
    full = [*defaults, *overrides, f"precision={preset}", f"seed={seed}", f"output_dir={quote(output_dir.resolve())}"]
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


def reuse_key(cfg: Any) -> str:
    """The composed config as a finished run is matched against it (YAML), with the keys that do
    nothing for the run's preset at their defaults: ``precision.moments_rounding`` where the preset
    keeps FP32 moments. So a gate of ``bf16_lean precision.moments_rounding=nearest`` reuses the
    reference runs of a gate of ``bf16_lean`` in the same ``--dir``."""
    from omegaconf import OmegaConf

    from amp_plugin.settings import PRESETS, MomentsRounding

    name = getattr(cfg.precision.precision, "value", cfg.precision.precision)
    if PRESETS[name].moments == "fp32" and "moments_rounding" in cfg.precision:
        cfg = cfg.copy()
        cfg.precision.moments_rounding = MomentsRounding.stochastic
    return OmegaConf.to_yaml(cfg)


def _reusable(out: Path, config_text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The finished run in ``out`` when it can stand for this one, else why not (None when there is none).

    It stands when its record has the same composed config, its summary says ``ok``, no ``FAILED`` note
    lies beside it, and ``summary.json`` is the file the run wrote (its SHA-256 is in the record)."""
    record_file, summary_file = out / "gate_run.json", out / "summary.json"
    if not (record_file.is_file() and summary_file.is_file()):
        return None, None
    try:
        record, text = json.loads(record_file.read_text()), summary_file.read_bytes()
        summary = json.loads(text)
    except (OSError, ValueError):
        return None, "its summary.json or gate_run.json cannot be read"
    if not isinstance(record, dict) or not isinstance(summary, dict) or record.get("config") != config_text:
        return None, None  # another config: not this run
    if (out / FAILED_FILE).exists():
        return None, f"a {FAILED_FILE} note lies beside its summary.json"
    if summary.get("status") != "ok":
        return None, f"its summary.json says status {summary.get('status')!r}"
    if record.get("summary_sha256") != hashlib.sha256(text).hexdigest():
        return None, "its summary.json is not the file the run wrote (edited, or written by another version)"
    return {**summary, "bytes_per_param": record["bytes_per_param"], "reused": True}, None


def _run_one(cfg: Any, out: Path, fresh: bool) -> dict[str, Any]:
    """Train (or reuse) one run; its summary plus ``bytes_per_param``, ``reused`` and, when a finished run
    there could not be reused, ``trained_again`` (why)."""
    from amp_plugin.app import reuse, rundir
    from amp_plugin.app.build import prepare
    from amp_plugin.app.run import train

    record_file, summary_file = out / "gate_run.json", out / "summary.json"
    config_text = reuse_key(cfg)
    why = None
    if not fresh:
        finished, why = _reusable(out, config_text)
        if finished is not None:
            return finished
    rundir.claim(out, "--dir")
    try:
        reuse.clear_outputs(out)
        record_file.unlink(missing_ok=True)
        result = train(cfg, prepare(cfg))
        with signals_held():  # a finished run is recorded whole, so the next gate reuses it
            late = result.get("late_signals") or []
            summary = {k: v for k, v in result.items() if k not in ("trainer", "module", "plugin", "late_signals")}
            del result
            per_param = summary["state_bytes_per_param"]  # state_bytes.per_parameter, as the run summary states it
            record = {"config": config_text, "bytes_per_param": per_param}
            if summary_file.is_file():
                record["summary_sha256"] = hashlib.sha256(summary_file.read_bytes()).hexdigest()
            record_file.write_text(json.dumps(record, indent=1) + "\n")
    finally:
        rundir.release(out)
    gc.collect()
    if late:  # a signal in the run's last step: the run finished and is recorded; the gate stops here
        raise Terminated(late[0])
    return {**summary, "bytes_per_param": per_param, "reused": False, **({"trained_again": why} if why else {})}


def _finished(out: Path, cfg: Any) -> bool:
    """Whether ``out`` holds a finished run of ``cfg`` that the next gate reuses (for :class:`Progress`)."""
    return _reusable(out, reuse_key(cfg))[0] is not None


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


def report_path(args: argparse.Namespace, candidate: str, reference: str) -> Path:
    """The report's path: ``--json``, else ``DIR/gate-A-vs-B.json``."""
    return args.json or args.dir / f"gate-{candidate}-vs-{reference}.json"


def log_path(args: argparse.Namespace, candidate: str, reference: str) -> Path:
    """The runs' output: ``DIR/<the report's name>.log``."""
    return args.dir / (report_path(args, candidate, reference).stem + ".log")


def _checked(configs: dict[tuple[str, int], Any], presets: Sequence[str], seed: int) -> str:
    """:func:`check_config` of each side's first run; returns what the checks printed."""
    with tempfile.TemporaryFile("w+") as scratch:
        with output_to(scratch):
            for preset in presets:
                check_config(configs[(preset, seed)], preset)
        scratch.seek(0)
        return scratch.read()


def _train(cfg: Any, preset: str, out: Path, fresh: bool, log: IO[str]) -> dict[str, Any]:
    """:func:`_run_one` with its output, and the traceback of a failure, in ``log``."""
    print(f"\namp-gate: precision={preset} seed={cfg.seed} -> {out}", file=log, flush=True)
    with output_to(log):
        try:
            return _run_one(cfg, out, fresh)
        except Exception:
            traceback.print_exc()
            raise


def run_gate(args: argparse.Namespace, progress: Progress | None = None) -> tuple[int, dict[str, Any]]:
    """Check, train, judge; returns ``(exit status, report)`` (:func:`main` writes the report).

    Prints one line naming the log file that receives everything the runs print, then a line per
    seed that grows as its two runs end (each run's wall time, or ``reused``). A signal stops it where it
    is (``progress`` says where, for :func:`main`'s message).
    """
    import torch

    candidate, reference, overrides = check_args(args)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    directory: Path = args.dir
    progress = progress or Progress(directory, 2 * len(seeds), args.fresh, _finished)
    plan = [(preset, seed) for seed in seeds for preset in (reference, candidate)]
    configs = {(p, s): compose_run(overrides, p, s, directory / p / f"seed{s}") for p, s in plan}
    progress.plan = [(p, s, directory / p / f"seed{s}", configs[(p, s)]) for p, s in plan]
    checks_output = _checked(configs, (reference, candidate), seeds[0])
    log_file = log_path(args, candidate, reference)
    report: dict[str, Any] = {
        "command": "amp-gate " + shlex.join([*args.overrides, "--against", reference, "--seeds", str(args.seeds)]),
        "candidate": candidate,
        "reference": reference,
        "seeds": seeds,
        "sigmas": args.sigmas,
        "tolerance": args.tolerance,
        "overrides": overrides,
        "dir": str(directory),
        "log": str(log_file),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "runs": [],
    }
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    directory.mkdir(parents=True, exist_ok=True)
    print(f"amp-gate: {len(plan)} runs of {reference} and {candidate}; their output goes to {log_file}", flush=True)
    with open(log_file, "w", buffering=1) as log:
        log.write(checks_output)
        for preset, seed in plan:
            out = directory / preset / f"seed{seed}"
            progress.begin(preset, seed, first=preset == reference)
            try:
                run = _train(configs[(preset, seed)], preset, out, args.fresh, log)
            except ConfigError as err:  # raised before the run trains
                progress.end("", last=True)
                raise GateInputError(f"precision={preset}: {err}") from err
            except Exception as err:
                progress.end(f"{preset} failed", last=True)
                message = " ".join(f"{type(err).__name__}: {err}".split())[:600]
                report["runs"].append({"preset": preset, "seed": seed, "dir": str(out), "status": "failed"})
                error = f"precision={preset} seed={seed} ({out}): {message} (traceback in {log_file})"
                report.update(verdict="failed", exit_status=1, error=error)
                return 1, report
            took = "reused" if run["reused"] else f"{run['wall_time_s']:.1f} s"
            if run.get("trained_again"):
                took += f" (trained again: {run['trained_again']})"
            progress.end(f"{preset} {took}", last=preset == candidate)
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
    status = 1 if verdict in ("worse", "undecided") else 0
    report.update(verdict=verdict, exit_status=status)
    if verdict == "undecided":
        names = ", ".join(v.metric for v in verdicts if v.verdict == "undecided")
        report["error"] = (
            f"{names}: the paired differences are all equal, so their standard error is 0 and there is no noise "
            "band to judge them against. Add seeds (--seeds), or give the difference you accept (--tolerance)."
        )
    return status, report


def main(argv: Sequence[str] | None = None) -> int:
    """The ``amp-gate`` console script; returns the exit status (see the module docstring).

    SIGTERM, SIGINT and SIGHUP stop it as they stop ``train.py`` (the run under way stops after its step):
    one line on stderr (:meth:`~amp_plugin.app.gate_progress.Progress.interrupted`), no report, exit status
    ``128 + signal`` (143, 130, 129). The finished runs stay in ``--dir`` for the next gate to reuse.
    """
    from amp_plugin.app.outcome import catch_sigterm, restore_sigterm, signal_of

    args = parse_args(argv)
    progress = Progress(args.dir, 2 * args.seeds, args.fresh, _finished)
    previous = catch_sigterm()  # SIGTERM raises outcome.Terminated, SIGHUP goes where SIGTERM goes
    try:
        return _gate(args, progress)
    except GateInputError as err:
        print(f"amp-gate: error: {err}", file=sys.stderr, flush=True)
        return 2
    except BaseException as err:  # RunInterrupted, Terminated, KeyboardInterrupt, Lightning's SIGTERMException
        signum = signal_of(err)
        if signum is None:
            raise
        print(progress.interrupted(signum, err), file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        restore_sigterm(previous)


def _gate(args: argparse.Namespace, progress: Progress) -> int:
    """:func:`run_gate`, then write the report and print it; the exit status."""
    from amp_plugin.app.report import to_json

    status, report = run_gate(args, progress)
    path = report_path(args, report["candidate"], report["reference"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(report) + "\n")
    print(format_report(report) + f"\nwrote {path}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
