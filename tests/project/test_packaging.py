"""The wheel ships every package of the source tree (pyproject.toml lists them by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_under_amp_plugin_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "amp_plugin").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk <= listed, f"missing from pyproject.toml: {sorted(on_disk - listed)}"
    mapped = config["package-dir"]
    for package, folder in mapped.items():
        assert package == "" or (ROOT / folder).is_dir(), package


def test_every_config_group_ships_in_the_wheel():
    """Each folder of configs/ is a package of the wheel, or amp-train outside a checkout misses that group."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    groups = {
        f"amp_plugin.app.configs.{d.name}" for d in (ROOT / "configs").iterdir() if d.is_dir() and any(d.glob("*.yaml"))
    }
    assert groups and groups <= listed, f"missing from pyproject.toml: {sorted(groups - listed)}"
