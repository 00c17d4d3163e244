"""Bad input changes nothing, and launcher leftovers switch off no guard, through the CLI.

- ``overwrite=true`` with a value that a check refuses leaves the finished run as it was, byte for
  byte (``.hydra/`` and ``train.log`` included): everything is checked before anything is deleted.
- ``overwrite=true`` deletes only the checkpoints the run in the directory wrote; a checkpoint of
  another run, or a file of the user's, makes it refuse, naming the file.
- A sweep's ``overwrite=true`` touches only its own jobs' directories, and a sweep judges only its
  own jobs (a stale ``FAILED`` beside them does not fail it).
- A job refused because another run holds its directory writes nothing there.
- ``RANK``/``WORLD_SIZE`` left in the environment are refused in one line; a ``WORLD_SIZE`` that
  cannot hold ``trainer.num_nodes`` x ``trainer.devices`` processes is refused before launching.
- A run whose every step was skipped fails, however short.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _cli_batch import run_batch
from _cli_procs import QUIET, ROOT, run

from amp_plugin.lightning import pl

pytestmark = pytest.mark.xdist_group("bad_input_changes_nothing_cli")

TINY = ["recipe=underflow_demo", "trainer.max_steps=3", "trainer.limit_val_batches=1", *QUIET]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones included, the lock file too) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def one_line_refusal(result: dict[str, Any], *named: str) -> str:
    output = result["stderr"] + result["stdout"]
    assert result["code"] == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    line = next((line for line in result["stderr"].splitlines() if all(n in line for n in named)), None)
    assert line is not None, result["stderr"][-3000:]
    return line


BAD_WITH_OVERWRITE = {
    "lr_negative": ["recipe.lr=-1"],
    "lr_nan": ["recipe.lr=nan"],
    "missing_ckpt": ["trainer.max_steps=5", "ckpt_path=no_such.ckpt"],
    "devices_64": ["trainer.devices=64"],
}

SET_ENV = "import os; os.environ.update({env})"
UNSET_ENV = "import os; [os.environ.pop(k, None) for k in {keys}]"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, dict], dict[str, dict[str, bytes]]]:
    work = tmp_path_factory.mktemp("unchanged")
    ops: list[dict[str, Any]] = [
        {"kind": "run", "name": "a", "args": TINY},
        {"kind": "run", "name": "b", "args": [*TINY, "seed=1"]},
        {"kind": "run", "name": "c", "args": [*TINY, "seed=2"]},
        {"kind": "run", "name": "d", "args": [*TINY, "seed=3"]},
        {
            "kind": "python",
            "code": "import shutil, json\nfrom pathlib import Path\n"
            "shutil.copy('b/checkpoints/last.ckpt', 'c/checkpoints/from_b.ckpt')\n"
            "Path('d/checkpoints/pretrained.ckpt').write_text('mine')\n"
            "snap = {str(p): p.read_bytes().hex() for d in ('a', 'c', 'd') for p in sorted(Path(d).rglob('*'))"
            " if p.is_file()}\n"
            "json.dump(snap, open('before.json', 'w'))\n",
        },
    ]
    ops += [
        {"kind": "run", "name": name, "dir": "a", "args": [*TINY, "overwrite=true", *extra]}
        for name, extra in BAD_WITH_OVERWRITE.items()
    ]
    ops += [
        {"kind": "run", "name": "other_run_ckpt", "dir": "c", "args": [*TINY, "overwrite=true"]},
        {"kind": "run", "name": "users_ckpt", "dir": "d", "args": [*TINY, "overwrite=true"]},
        {"kind": "python", "code": SET_ENV.format(env={"WORLD_SIZE": "2", "RANK": "1"})},
        {"kind": "run", "name": "leftover_rank", "dir": "a", "args": [*TINY, "seed=5"]},
        {"kind": "run", "name": "leftover_rank_fresh", "args": [*TINY, "seed=5"]},
        {"kind": "python", "code": UNSET_ENV.format(keys=["WORLD_SIZE", "RANK"])},
        {"kind": "python", "code": SET_ENV.format(env={"WORLD_SIZE": "1"})},
        {"kind": "run", "name": "world_1_nodes_2", "args": [*TINY, "trainer.num_nodes=2", "strategy=ddp"]},
        {"kind": "python", "code": UNSET_ENV.format(keys=["WORLD_SIZE"])},
        {"kind": "run", "name": "all_skipped", "args": [*TINY, "trainer.max_steps=9", "+fault.inject_inf_from=0"]},
    ]
    results = run_batch(work, ops)
    before = json.loads((work / "before.json").read_text())
    snaps: dict[str, dict[str, bytes]] = {}
    for key, value in before.items():
        top, _, rest = key.partition("/")
        snaps.setdefault(top, {})[rest] = bytes.fromhex(value)
    return work, results, snaps


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD_WITH_OVERWRITE))
def test_overwrite_with_a_bad_value_leaves_the_finished_run_as_it_was(runs, name):
    work, results, before = runs
    result = results[name]
    assert result["code"] == 1, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert "Invalid configuration" in result["stderr"]
    assert snapshot(work / "a") == before["a"]  # summary, checkpoints, logs, .hydra/, train.log: all as they were


@pytest.mark.slow
def test_overwrite_refuses_a_checkpoint_another_run_wrote_naming_it(runs):
    work, results, before = runs
    line = one_line_refusal(results["other_run_ckpt"], "overwrite=true", "checkpoints/from_b.ckpt")
    assert "another run" in line
    assert snapshot(work / "c") == before["c"]


@pytest.mark.slow
def test_overwrite_refuses_a_users_own_checkpoint_naming_it(runs):
    work, results, before = runs
    one_line_refusal(results["users_ckpt"], "overwrite=true", "checkpoints/pretrained.ckpt")
    assert (work / "d/checkpoints/pretrained.ckpt").read_text() == "mine"
    assert snapshot(work / "d") == before["d"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["leftover_rank", "leftover_rank_fresh"])
def test_rank_variables_left_in_the_environment_are_refused_in_one_line(runs, name):
    work, results, before = runs
    line = one_line_refusal(results[name], "RANK=1", "WORLD_SIZE=2")
    assert "Unset" in line
    assert snapshot(work / "a") == before["a"]  # the finished run's directory, as it was
    if name == "leftover_rank_fresh":
        assert not {"logs", "checkpoints", "summary.json", ".hydra"} & set(results[name]["listing"] or [])


@pytest.mark.slow
def test_a_world_size_that_cannot_hold_the_nodes_is_refused_before_launching(runs):
    _, results, _ = runs
    line = one_line_refusal(results["world_1_nodes_2"], "WORLD_SIZE=1", "trainer.num_nodes=2")
    assert "2 processes" in line


@pytest.mark.slow
def test_a_short_run_whose_every_step_was_skipped_fails(runs):
    work, results, _ = runs
    line = one_line_refusal(results["all_skipped"], "Training stopped", "were all skipped")
    assert "9 of its 9 steps" in line
    assert json.loads((work / "all_skipped/summary.json").read_text())["status"] == "failed"


# ---------------------------------------------------------------------------------- sweeps
@pytest.mark.slow
def test_a_sweeps_overwrite_touches_only_its_own_jobs_and_judges_only_them(tmp_path):
    results = tmp_path / "results"
    batch = run_batch(tmp_path, [{"kind": "run", "name": "baseline", "dir": "results/baseline", "args": TINY}])
    assert batch["baseline"]["code"] in (0, None), batch["baseline"]["stderr"][-3000:]
    stale = results / "7"
    stale.mkdir()
    (stale / "FAILED").write_text("RuntimeError: an old sweep's job\n")
    before = snapshot(results / "baseline")
    sweep = run(["-m", *TINY, f"hydra.sweep.dir={results}", "overwrite=true", "seed=1,2"], tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert snapshot(results / "baseline") == before
    assert (stale / "FAILED").read_text() == "RuntimeError: an old sweep's job\n"
    for job in ("0", "1"):
        assert json.loads((results / job / "summary.json").read_text())["status"] == "ok"


class HoldDirectory(pl.Callback):
    """While job 0 of a sweep sets up: another run takes ``directory`` (job 1's) and writes its files."""

    def __init__(self, directory: str, pid_file: str) -> None:
        self.directory, self.pid_file = Path(directory), Path(pid_file)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.pid_file.exists():
            return
        (self.directory / ".hydra").mkdir(parents=True, exist_ok=True)
        (self.directory / ".hydra" / "config.yaml").write_text("precision: mine\n")
        (self.directory / "train.log").write_text("mine\n")
        code = (
            "import sys, time; from amp_plugin.app import rundir; rundir.claim(sys.argv[1]); "
            "print('held', flush=True); time.sleep(120)"
        )
        clean = {k: v for k, v in os.environ.items() if not k.startswith("AMP_PLUGIN_RUN_DIR")}
        # stderr not inherited: the sweep's captured stderr would stay open (and the test wait) until it exits
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(self.directory)],
            cwd=ROOT,
            env=clean,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        self.pid_file.write_text(str(proc.pid))


@pytest.mark.slow
def test_a_job_refused_because_another_run_took_its_directory_writes_nothing_there(tmp_path):
    results, pid_file = tmp_path / "results", tmp_path / "holder.pid"
    args = [
        "-m",
        *TINY,
        f"hydra.sweep.dir={results}",
        "seed=1,2",
        "+callbacks.hold._target_=test_bad_input_changes_nothing_cli.HoldDirectory",
        f"+callbacks.hold.directory={results / '1'}",
        f"+callbacks.hold.pid_file={pid_file}",
    ]
    try:
        sweep = run(args, tmp_path)
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), 9)
            time.sleep(0.2)
    assert sweep.returncode == 1, sweep.stderr[-3000:]
    assert "Traceback" not in sweep.stderr
    assert f"hydra.run.dir={os.path.realpath(results / '1')} is in use" in sweep.stderr
    held = results / "1"
    assert (held / ".hydra" / "config.yaml").read_text() == "precision: mine\n"
    assert (held / "train.log").read_text() == "mine\n"
    assert sorted(p.name for p in held.iterdir() if p.name != ".lock") == [".hydra", "train.log"]
    shutil.rmtree(held)


# ---------------------------------------------------------------------------------- unclear before: one line now
UNCLEAR = {
    "limit_val_tiny": (["trainer.limit_val_batches=1e-9"], "trainer.limit_val_batches=1e-09"),
    "limit_train_tiny": (["trainer.limit_train_batches=1e-9"], "trainer.limit_train_batches=1e-09"),
    "val_check_true": (["trainer.val_check_interval=true"], "trainer.val_check_interval=true"),
    "limit_train_true": (["trainer.limit_train_batches=true"], "trainer.limit_train_batches=true"),
}


@pytest.fixture(scope="module")
def unclear(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("unclear")
    ops = [{"kind": "run", "name": name, "args": [*TINY, *extra]} for name, (extra, _) in UNCLEAR.items()]
    return run_batch(work, ops)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNCLEAR))
def test_trainer_amounts_lightning_would_misread_or_trace_back_on_are_refused_in_one_line(unclear, name):
    line = one_line_refusal(unclear[name], UNCLEAR[name][1], "is not allowed")
    assert "Invalid configuration" in line
    assert not {"logs", "checkpoints", "summary.json"} & set(unclear[name]["listing"] or [])


@pytest.mark.parametrize(
    ("override", "fixed"),
    [
        ("ckpt_path=~/runs/last.ckpt", "'ckpt_path=\"~/runs/last.ckpt\"'"),
        ("hydra.run.dir=runs/a(b)", "'hydra.run.dir=\"runs/a(b)\"'"),
    ],
)
def test_an_unquoted_special_character_in_a_value_gets_the_quoted_override_in_one_line(tmp_path, override, fixed):
    result = run([override, *TINY], tmp_path, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "LexerNoViableAltException" not in result.stderr, result.stderr
    assert lines[0].startswith(f"Invalid override {override!r}") and f"write {fixed}" in lines[0]
    if "~" in override:
        assert "$HOME" in lines[0]
    assert list(tmp_path.iterdir()) == []
