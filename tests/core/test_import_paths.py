"""The import paths users have: the scalers' old modules still work and warn, naming the new path;
``amp_plugin.callbacks`` (the design's path) works without a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import amp_plugin
import amp_plugin.scaling

OLD_SCALER = {
    "HalfLossWarning": "amp_plugin",
    "LossScaler": "amp_plugin",
    "ScaleUpdate": "amp_plugin",
    "StaticLossScaler": "amp_plugin",
    "to_float32": "amp_plugin.scaling",
    "unscale_grouped": "amp_plugin.scaling.unscale",
}
OLD_DYNAMIC = {
    "DynamicLossScaler": "amp_plugin",
    "LossScaleCollapseError": "amp_plugin",
    "HysteresisReset": "amp_plugin.scaling",
    "OnMinScale": "amp_plugin.scaling",
}


@pytest.mark.parametrize(
    "old,name,new",
    [("amp_plugin.scaler", n, m) for n, m in OLD_SCALER.items()]
    + [("amp_plugin.dynamic_scaler", n, m) for n, m in OLD_DYNAMIC.items()],
)
def test_an_old_scaler_path_gives_the_same_object_and_warns_with_the_new_path(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"^{old} is deprecated .*: use `from {new} import {name}`$") as seen:
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)  # the new path, the same object
    assert seen[0].filename == __file__  # the warning points at the line that used the old path
    assert name in dir(module) and name in module.__all__


def test_the_new_paths_import_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from amp_plugin import DynamicLossScaler, LossScaler, StaticLossScaler  # noqa: F401
        from amp_plugin.scaling import HysteresisReset, OnMinScale, to_float32  # noqa: F401
        from amp_plugin.scaling.unscale import unscale_grouped  # noqa: F401
    assert set(OLD_SCALER) - {"unscale_grouped"} <= set(amp_plugin.scaling.__all__)
    assert set(OLD_DYNAMIC) <= set(amp_plugin.scaling.__all__)


def test_from_the_old_path_import_warns_in_a_users_script_and_still_works():
    """Python shows a DeprecationWarning where ``__main__`` triggers it: a user's own script sees it."""
    code = (
        "from amp_plugin.dynamic_scaler import DynamicLossScaler\n"
        "from amp_plugin.scaler import StaticLossScaler\n"
        "print(DynamicLossScaler().get_scale(), StaticLossScaler(8.0).get_scale())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["65536.0", "8.0"]
    assert "use `from amp_plugin import DynamicLossScaler`" in done.stderr
    assert "use `from amp_plugin import StaticLossScaler`" in done.stderr


def test_an_unknown_name_on_an_old_path_is_an_attribute_error():
    import amp_plugin.scaler

    with pytest.raises(AttributeError, match="module 'amp_plugin.scaler' has no attribute 'Nope'"):
        amp_plugin.scaler.Nope  # noqa: B018


def test_the_callbacks_path_of_the_design_stays_without_a_warning():
    pytest.importorskip("lightning")
    import amp_plugin.lightning.callbacks as home

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import amp_plugin.callbacks as design

        names = [name for name in design.__all__ if getattr(design, name) is not getattr(home, name)]
    assert not names
    assert {"LossScaleMonitor", "GradientHealthMonitor", "PreflightChecks", "FP8Monitor"} <= set(design.__all__)


def test_the_projects_own_modules_import_without_a_deprecation_warning():
    """The app, its entry point and the recipes import the scalers from their new paths: run with
    ``-W error::DeprecationWarning``, as a user who turns deprecations into errors would, nothing fails."""
    pytest.importorskip("hydra")
    code = (
        "import pkgutil, importlib, amp_plugin.app, recipes\n"
        "import amp_plugin.app.cli\n"
        "for package in (amp_plugin.app, recipes):\n"
        "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]
    assert "is deprecated" not in done.stderr
