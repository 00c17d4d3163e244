"""Run many ``train.py`` command lines in ONE subprocess, through the real ``@hydra.main`` entry.

A table of command lines then costs one torch/Lightning import instead of one per row. Each
op is ``{"kind": "run", "name": ..., "args": [...]}`` (its run directory is ``<work>/<name>``,
or ``<work>/<dir>`` with a ``"dir"`` key: several runs into one directory)
or ``{"kind": "python", "code": ...}`` (executed in the work directory, e.g. to prepare files
from an earlier run). Each run's result: ``code`` (the SystemExit status the process would
have exited with), ``stdout``, ``stderr``, ``listing`` (the run directory's files, or None)
and ``dir``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_DRIVER = """
import contextlib, io, json, os, runpy, sys, warnings
from hydra.core.global_hydra import GlobalHydra
root, ops_file, out_file = sys.argv[1:4]
sys.path.insert(0, root)
results = {}
for op in json.load(open(ops_file)):
    if op["kind"] == "python":
        exec(op["code"], {})
        continue
    run_dir = os.path.abspath(op.get("dir", op["name"]))
    sys.argv = ["train.py", *op["args"], f"hydra.run.dir={run_dir}"]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        try:
            runpy.run_path(os.path.join(root, "train.py"), run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    GlobalHydra.instance().clear()
    listing = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else None
    results[op["name"]] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                           "listing": listing, "dir": run_dir}
json.dump(results, open(out_file, "w"))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without HYDRA_FULL_ERROR (its tracebacks are what the tests rule out)."""
    return {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | extra


def run_batch(work: Path, ops: list[dict], timeout: float = 600) -> dict[str, dict]:
    """Run ``ops`` in ``work``; return the results of the "run" ops by name."""
    (work / "driver.py").write_text(_DRIVER)
    (work / "ops.json").write_text(json.dumps(ops))
    proc = subprocess.run(
        [sys.executable, "driver.py", str(ROOT), "ops.json", "results.json"],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((work / "results.json").read_text())
