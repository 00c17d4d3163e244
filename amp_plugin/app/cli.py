"""Command-line entry points: ``train.py`` and the ``amp-train`` console script.

Both compose the same configs (``configs/train.yaml`` and its groups) and call
:func:`run_job`, which turns a bad config (:class:`~amp_plugin.app.validation.ConfigError`) or a
collapsed loss scale into one short message on stderr and exit status 1, with no traceback.
``HYDRA_FULL_ERROR=1`` shows the full traceback instead. A value that the schemas reject while
Hydra composes the config (a wrong type, an unknown key, a value outside a choice) never reaches
:func:`run_job`: Hydra prints its message (the key, the value, the allowed values) and exits
with status 1.

Where ``amp-train`` finds the configs, first match wins:

1. ``$AMP_PLUGIN_CONFIG_DIR``;
2. ``configs/`` of the source checkout the package was imported from (``pip install -e .``);
3. ``amp_plugin/app/configs`` inside an installed wheel (packaged from the same ``configs/``).

Hydra's ``--config-dir DIR`` adds a directory of your own presets on top of these.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from amp_plugin.app.build import prepare
from amp_plugin.app.schema import register_configs
from amp_plugin.app.validation import ConfigError
from amp_plugin.dynamic_scaler import LossScaleCollapseError

__all__ = ["SweepFailures", "config_dir", "main", "run_job"]

CONFIG_NAME = "train"


def config_dir() -> str:
    """The directory holding ``train.yaml`` (see the module docstring for the search order)."""
    package = Path(__file__).resolve().parent
    candidates = [os.environ.get("AMP_PLUGIN_CONFIG_DIR"), package.parents[1] / "configs", package / "configs"]
    for candidate in candidates:
        if candidate and (Path(candidate) / f"{CONFIG_NAME}.yaml").is_file():
            return str(Path(candidate).resolve())
    raise FileNotFoundError(
        "amp_plugin: no configs found (looked in " + ", ".join(str(c) for c in candidates if c)
        + "). Set AMP_PLUGIN_CONFIG_DIR to a directory holding train.yaml."
    )


def _hydra_runtime() -> tuple[Path | None, bool]:
    """The job's output directory and whether it is one job of a multirun (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not running under @hydra.main
        return None, False
    return Path(hydra_cfg.runtime.output_dir), hydra_cfg.mode == RunMode.MULTIRUN


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """The body of a Hydra job: check and train, and report bad input without a traceback.

    A single run exits with status 1 on a bad config or a collapsed loss scale. In a
    multirun the failed job leaves its message in ``FAILED`` and the sweep goes on; the
    process exits with status 1 at the end (:class:`SweepFailures`).
    """
    try:
        settings = prepare(cfg)  # every check and the scaler, before importing Lightning: a typo fails fast
        from amp_plugin.app.run import train

        result = train(cfg, settings)
        return {k: v for k, v in result.items() if k not in ("trainer", "module", "plugin")}
    except (ConfigError, LossScaleCollapseError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        out, multirun = _hydra_runtime()
        if out is not None and out.is_dir() and not (out / "FAILED").exists():
            (out / "FAILED").write_text(f"{type(err).__name__}: {err}\n")
        kind = "Invalid configuration" if isinstance(err, ConfigError) else "Training stopped"
        if multirun:
            print(f"{kind}: {err}\n(This job failed; the sweep goes on.)", file=sys.stderr, flush=True)
            return None
        print(f"{kind}: {err}\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
              file=sys.stderr, flush=True)
        sys.exit(1)


class SweepFailures(Callback):
    """Hydra callback: after a multirun, list the jobs that failed and exit with status 1."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        failed = sorted(p.parent for p in sweep_dir.glob("*/FAILED"))
        if not failed:
            return
        lines = [f"{len(failed)} job(s) of this sweep failed:"]
        for job in failed:
            first = (job / "FAILED").read_text().strip().splitlines()[0]
            lines.append(f"  {job}: {first[:160]}")
        lines.append(f"Compare the runs with: amp-compare {sweep_dir}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    """The ``amp-train`` console script: the same CLI as ``python train.py``."""
    import hydra

    register_configs()
    hydra.main(config_path=config_dir(), config_name=CONFIG_NAME, version_base="1.3")(run_job)()


if __name__ == "__main__":
    main()
