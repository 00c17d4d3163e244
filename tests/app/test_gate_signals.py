"""``amp-gate`` stopped by a signal ends as ``train.py`` does: exit ``128 + signal`` (143 SIGTERM, 130 SIGINT,
129 SIGHUP), one line on stderr naming the run it stopped, the runs kept and what the same command does next,
no traceback, no report; the finished runs are reused by the next gate and the stopped one trains again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from amp_plugin.app import gate
from amp_plugin.app.outcome import Terminated
from amp_plugin.lightning import pl

TINY = ["recipe=digits", "recipe.hidden_sizes=[16]", "trainer.max_steps=4", "trainer.limit_val_batches=1"]
ARGV = ["precision=bf16_split", "--against", "bf16", "--seeds", "2", *TINY]
STALL_ENV = "AMP_GATE_TEST_STALL"


def _fake_train(
    monkeypatch, stop: dict[tuple[str, int], BaseException], late: dict[tuple[str, int], int] | None = None
) -> list[tuple[str, int]]:
    """Replace ``run.train`` with one that writes a finished run's ``summary.json``, or raises ``stop[(preset,
    seed)]``, and returns ``late[(preset, seed)]`` as a signal held in its last step; record which runs
    trained. ``_run_one`` around it is the gate's own (records, reuse)."""
    import amp_plugin.app.run

    trained: list[tuple[str, int]] = []

    def train(cfg, settings=None, **kwargs):
        preset, seed = _preset(cfg), cfg.seed
        trained.append((preset, seed))
        if (preset, seed) in stop:
            raise stop[(preset, seed)]
        bpp = {"params": 10, "weights": 2.0, "grads": 2.0, "master": 4.0, "master_grads": 0.0, "moments": 8.0}
        summary = {
            "status": "ok",
            "steps": 4,
            "skipped_steps": 0,
            "wall_time_s": 1.0,
            "final_metrics": {"val/loss": 1.0 + 0.1 * seed + (0.01 if preset == "bf16" else 0.0)},
            "state_bytes_per_param": {**bpp, "total": 16.0},
        }
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "summary.json").write_text(json.dumps(summary) + "\n")
        return {**summary, "late_signals": [late[(preset, seed)]] if (preset, seed) in (late or {}) else []}

    monkeypatch.setattr(amp_plugin.app.run, "train", train)
    return trained


def _main(argv: list[str]) -> int:
    """``amp-gate ARGV``'s exit status; a signal's exception that escapes it fails the test, not the session
    (a ``KeyboardInterrupt`` would stop pytest)."""
    try:
        return gate.main(argv)
    except BaseException as err:
        pytest.fail(f"amp-gate let {type(err).__name__} escape (a traceback, exit 1): {err}")


def _stop_the_test(signum: int, frame: Any) -> None:
    raise AssertionError(f"{signal.Signals(signum).name} reached the test: amp-gate did not handle it")


def _preset(cfg: Any) -> str:
    return getattr(cfg.precision.precision, "value", cfg.precision.precision)


def _interrupted(signum: int) -> BaseException:
    from amp_plugin.lightning.interrupt import RunInterrupted

    return RunInterrupted(signum, 2, None)


@pytest.mark.parametrize(
    ("error", "status", "name", "step"),
    [
        (lambda: _interrupted(signal.SIGTERM), 143, "SIGTERM", " (it stopped after step 2)"),
        (lambda: _interrupted(signal.SIGINT), 130, "SIGINT", " (it stopped after step 2)"),
        (lambda: _interrupted(signal.SIGHUP), 129, "SIGHUP", " (it stopped after step 2)"),
        (KeyboardInterrupt, 130, "SIGINT", ""),  # a second Ctrl+C, or one outside a training step
        (lambda: Terminated(signal.SIGTERM), 143, "SIGTERM", ""),  # outside a step: setup, between runs
    ],
)
def test_a_signal_during_a_run_exits_128_plus_it_with_one_line_and_keeps_the_finished_runs(
    tmp_path, monkeypatch, capsys, error, status, name, step
):
    trained = _fake_train(monkeypatch, {("bf16_split", 0): error()})
    assert _main([*ARGV, "--dir", str(tmp_path)]) == status
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err == (
        f"amp-gate: interrupted by {name} while training precision=bf16_split seed=0{step}; 1 of 4 runs are "
        f"finished in {tmp_path} and kept. To go on, run the same command again: it reuses those, trains the "
        f"other 3 (precision=bf16_split seed=0 from step 0) and writes the report (exit {status}).\n"
    )
    assert captured.out.splitlines()[1:] == ["  seed 0: bf16 1.0 s, bf16_split interrupted"]  # the line is ended
    assert trained == [("bf16", 0), ("bf16_split", 0)]
    assert (tmp_path / "bf16" / "seed0" / "gate_run.json").is_file()
    assert not (tmp_path / "gate-bf16_split-vs-bf16.json").exists()  # no report of a gate that did not end


def test_the_same_command_again_reuses_the_finished_runs_and_trains_the_stopped_one(tmp_path, monkeypatch, capsys):
    _fake_train(monkeypatch, {("bf16_split", 0): _interrupted(signal.SIGTERM)})
    assert _main([*ARGV, "--dir", str(tmp_path)]) == 143
    trained = _fake_train(monkeypatch, {})
    assert _main([*ARGV, "--dir", str(tmp_path)]) in (0, 1)
    assert trained == [("bf16_split", 0), ("bf16", 1), ("bf16_split", 1)]
    report = json.loads((tmp_path / "gate-bf16_split-vs-bf16.json").read_text())
    assert [r["reused"] for r in report["runs"]] == [True, False, False, False]


def test_a_signal_between_runs_and_with_fresh_says_so(tmp_path, monkeypatch, capsys):
    _fake_train(monkeypatch, {("bf16", 1): KeyboardInterrupt()})
    assert _main([*ARGV, "--fresh", "--dir", str(tmp_path)]) == 130
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1:] == ["  seed 0: bf16 1.0 s, bf16_split 1.0 s", "  seed 1: bf16 interrupted"]
    assert "2 of 4 runs are finished" in captured.err and "run the same command without --fresh" in captured.err
    assert "trains the other 2 (precision=bf16 seed=1 from step 0)" in captured.err


def test_a_signal_in_a_runs_last_step_stops_the_gate_once_the_run_is_recorded(tmp_path, monkeypatch, capsys):
    """SIGTERM in a run's last step lets the run finish (train.py's rule); the gate then stops after recording
    it, as for a signal between runs. It went on to the next run, and a second signal was needed."""
    trained = _fake_train(monkeypatch, {}, late={("bf16_split", 0): signal.SIGTERM})
    assert _main([*ARGV, "--dir", str(tmp_path)]) == 143
    captured = capsys.readouterr()
    assert trained == [("bf16", 0), ("bf16_split", 0)]
    assert captured.out.splitlines()[1:] == ["  seed 0: bf16 1.0 s, bf16_split finished"]
    assert "interrupted by SIGTERM between two runs; 2 of 4 runs are finished" in captured.err
    assert (tmp_path / "bf16_split" / "seed0" / "gate_run.json").is_file()  # kept: the next gate reuses it


def test_a_signal_while_a_finished_run_is_recorded_waits_until_it_is_recorded(tmp_path, monkeypatch, capsys):
    """SIGTERM between a run's summary.json and its gate_run.json is held: the run is kept for the next gate."""
    import amp_plugin.app.run

    _fake_train(monkeypatch, {})
    trained = amp_plugin.app.run.train

    class Signalling(dict):
        def items(self):  # the first thing the gate does with a finished run's result
            signal.raise_signal(signal.SIGTERM)
            return super().items()

    def train(cfg, settings=None, **kwargs):
        result = trained(cfg, settings)
        return Signalling(result) if _preset(cfg) == "bf16_split" else result

    monkeypatch.setattr(amp_plugin.app.run, "train", train)
    previous = signal.signal(signal.SIGTERM, _stop_the_test)  # not the default, which would end pytest
    try:
        assert _main([*ARGV, "--dir", str(tmp_path)]) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1:] == ["  seed 0: bf16 1.0 s, bf16_split finished"]
    assert captured.err.startswith("amp-gate: interrupted by SIGTERM between two runs; 2 of 4 runs are finished")
    assert (tmp_path / "bf16_split" / "seed0" / "gate_run.json").is_file()


class StallAfter(pl.Callback):
    """In a run whose directory contains ``only_in``, while ``$AMP_GATE_TEST_STALL`` is set: from step
    ``after_step`` on, write ``marker`` and sleep ``seconds`` after every step (a window to signal it in)."""

    def __init__(self, marker: str, only_in: str, after_step: int, seconds: float) -> None:
        self.marker, self.only_in, self.after_step, self.seconds = marker, only_in, after_step, seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stall = os.environ.get(STALL_ENV) and self.only_in in str(trainer.default_root_dir)
        if stall and trainer.global_step >= self.after_step:
            Path(self.marker).write_text(f"step {trainer.global_step}\n")
            time.sleep(self.seconds)


def _start_gate(args: list[str], cwd: Path, stall: bool) -> subprocess.Popen:
    from _cli_procs import env

    command = [sys.executable, "-m", "amp_plugin.app.gate", *args]
    extra = {STALL_ENV: "1"} if stall else {}
    return subprocess.Popen(
        command, cwd=cwd, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_real_signal_stops_the_gate_after_a_step_and_the_same_command_goes_on(tmp_path, signum, status):
    from _cli_procs import wait_until

    marker = tmp_path / "stalled"
    args = [
        "precision=bf16_split",
        "--against",
        "bf16",
        "--seeds",
        "2",
        "recipe=digits",
        "recipe.hidden_sizes=[16]",
        "trainer.max_steps=30",
        "trainer.limit_val_batches=1",
        "callbacks=none",
        "+callbacks.stall._target_=test_gate_signals.StallAfter",
        f"+callbacks.stall.marker={marker}",
        "+callbacks.stall.only_in=bf16_split",
        "+callbacks.stall.after_step=2",
        "+callbacks.stall.seconds=0.5",
        "--dir",
        str(tmp_path / "g"),
    ]
    proc = _start_gate(args, tmp_path, stall=True)
    try:
        wait_until(marker.is_file, proc)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, out + err
    assert "Traceback" not in err and err.count("\n") == 1, err
    name = signal.Signals(signum).name
    assert err.startswith(f"amp-gate: interrupted by {name} while training precision=bf16_split seed=0 (it stopped ")
    assert f"1 of 4 runs are finished in {tmp_path / 'g'} and kept" in err
    assert out.splitlines()[1].startswith("  seed 0: bf16 ") and out.endswith(", bf16_split interrupted\n"), out
    if signum != signal.SIGTERM:
        return
    # the same command again (without the stall): bf16 seed 0 is reused, bf16_split seed 0 trains from step 0
    again = _start_gate(args, tmp_path, stall=False)
    out, err = again.communicate(timeout=300)
    assert again.returncode in (0, 1), out + err
    report = json.loads((tmp_path / "g" / "gate-bf16_split-vs-bf16.json").read_text())
    assert [(r["preset"], r["reused"], r["steps"]) for r in report["runs"]] == [
        ("bf16", True, 30),
        ("bf16_split", False, 30),
        ("bf16", False, 30),
        ("bf16_split", False, 30),
    ]
    assert not (tmp_path / "g" / "bf16_split" / "seed0" / "FAILED").exists()
