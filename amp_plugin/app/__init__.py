"""The Hydra app: config schemas, ``train(cfg)``, per-run plots and run comparison.

``train`` is imported lazily (it pulls in Lightning); the schemas and :func:`prepare` are not,
so checking a config and building its scaler and precision settings cost no Lightning import.
"""

from __future__ import annotations

from typing import Any

from amp_plugin.app.build import prepare
from amp_plugin.app.schema import register_configs
from amp_plugin.app.validation import ConfigError, validate

__all__ = ["ConfigError", "prepare", "register_configs", "train", "validate"]


def train(cfg: Any, settings: Any = None) -> dict[str, Any]:
    """See :func:`amp_plugin.app.run.train`."""
    from amp_plugin.app.run import train as _train

    return _train(cfg, settings)
