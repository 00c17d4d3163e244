"""Fixtures shared across test modules.

The folders mirror the package: ``core/`` (the loss scalers), ``master_weights/``, ``fused/``,
``emulation/``, ``fp8/``, ``lightning/`` (the plugin, its callbacks, Lightning's loops and
launchers), ``app/`` (``train.py``, the configs, the CLI tools), ``recipes/``, and ``project/``
(the README, the docs' commands, packaging, the benchmarks' smoke runs). Helpers shared by
several folders (``_models.py``, the DDP workers, the CLI runners) sit here, on ``sys.path``
for every test module since this file's folder is.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from _emulation_helpers import BACKENDS, DTYPES, ids

from amp_plugin import fused
from amp_plugin.lightning import NAMESPACES

ROOT = Path(__file__).resolve().parents[1]
RUN_ARTEFACTS = ("grad_health.csv", "scale_events.csv", "fp8_stats.csv", "lightning_logs", "checkpoints", "gate")
"""What a run writes into the working directory when a test forgets to name one."""
_artefacts_before: set[str] = set()


class FileProgress:
    """Under pytest-xdist (``-n 2``) the terminal shows one dot per test and no file names: this
    starts a line with each test file's path when its first test starts, as a run without workers
    does, so a long run shows where it is (the dots after it are both workers')."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started: set[str] = set()

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        path = nodeid.split("::", 1)[0]
        if path not in self.started:
            self.started.add(path)
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_ensure_prefix(path + " ")


def pytest_configure(config: pytest.Config) -> None:
    workers = getattr(config.option, "numprocesses", None)
    if workers and config.option.verbose <= 0 and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileProgress(config), "amp-file-progress")


def pytest_sessionstart(session) -> None:
    """Build (or load) the fused kernels once, up front: the first build takes about 25 s,
    which would otherwise land inside whichever test, or training subprocess, comes first."""
    _artefacts_before.update(name for name in RUN_ARTEFACTS if (ROOT / name).exists())
    fused.kernels()


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the session when a test left run files in the repository: every test writes under a
    temporary directory (``tmp_path``, or ``default_root_dir`` for a Trainer without a logger)."""
    left = [name for name in RUN_ARTEFACTS if (ROOT / name).exists() and name not in _artefacts_before]
    if left:
        session.config.get_terminal_writer().line(f"Tests left run files in {ROOT}: {', '.join(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _compiled_step_state_kept(monkeypatch):
    """The compiled lean step's process-wide switch to its uncompiled functions (taken when a batch fails to
    compile, e.g. at Dynamo's recompile limit, which the tests' many small slabs reach) left as each test found
    it: a later test in the same worker that times compiling still compiles, whatever ran before it."""
    from amp_plugin.master_weights import _compiled

    monkeypatch.setitem(_compiled._state, "eager", _compiled._state["eager"])


@pytest.fixture
def compose_config():
    """``configs/train.yaml`` composed as on the command line: ``compose_config(*overrides, output_dir=...)``.

    ``output_dir`` defaults to a path that does not exist, for tests that compose but never run.
    """
    from hydra import compose, initialize_config_dir

    from amp_plugin.app.schema import register_configs

    def compose_train(*overrides: str, output_dir: str | Path = "/nonexistent/amp_plugin_test"):
        register_configs()
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            return compose("train", overrides=[*overrides, f"output_dir={output_dir}"])

    return compose_train


@pytest.fixture(params=DTYPES, ids=lambda d: ids[d])
def dtype(request) -> torch.dtype:
    """FP16 and BF16: the dtypes CpuHalfEmulation emulates."""
    return request.param


@pytest.fixture(params=[*BACKENDS, "kernel-python"])
def backend(request, monkeypatch) -> str:
    """Both interception backends of CpuHalfEmulation; "kernel-python" is the "kernel" backend
    with its Python kernels only (what runs where the C++ kernels cannot be built)."""
    if request.param == "kernel-python":
        from amp_plugin.emulation import _backends

        monkeypatch.setattr(_backends, "USE_NATIVE_KERNELS", False)
        return "kernel"
    return request.param


@pytest.fixture(params=NAMESPACES, ids=lambda ns: ns.__name__)
def pl(request) -> ModuleType:
    """Each installed Lightning namespace in turn (``lightning.pytorch``, ``pytorch_lightning``):
    the plugin and callback suites run against both from one set of tests."""
    return request.param


@pytest.fixture
def simulate(monkeypatch):
    """Pretend to run on another CPU: ``simulate(simulated_cpu(...))``; the real probe comes back after."""
    from amp_plugin.emulation import _cpu

    def apply(features):
        monkeypatch.setattr(_cpu, "_detect", lambda: features)
        _cpu._clear_cache()

    yield apply
    monkeypatch.undo()
    _cpu._clear_cache()
