"""``amp-gate`` (amp_plugin.app.gate): bad input exits 2 before training, the verdict sets the exit
status, a failed run fails the gate, and one small end-to-end gate (slow)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest

from amp_plugin.app import gate
from amp_plugin.app.gate import main

TINY = ["recipe=digits", "recipe.hidden_sizes=[16]", "trainer.max_steps=4", "trainer.limit_val_batches=1"]


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line
    return err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--against", "bf16", "recipe=digits"], "precision=PRESET must be given once (got 0: [])"),
        (
            ["precision=bf16_nope", "--against", "bf16"],
            "precision='bf16_nope' is not a preset; allowed: bf16, bf16_autocast,",
        ),
        (["precision=fp16", "--against", "fp4"], "--against='fp4' is not a preset; allowed: bf16,"),
        (["precision=fp16", "precision=bf16", "--against", "bf16"], "precision=PRESET must be given once (got 2"),
        (["precision=bf16", "--against", "bf16"], "precision=bf16 and --against=bf16 are the same preset"),
        (["precision=fp16", "--against", "bf16", "--seeds", "1"], "--seeds=1: a standard error needs at least 2"),
        (
            ["precision=fp16", "--against", "bf16", "--tolerance", "-0.1"],
            "--tolerance=-0.1: allowed values are finite numbers >= 0 (not nan or inf).",
        ),
        (["precision=fp16", "--against", "bf16", "--sigmas", "nan"], "--sigmas=nan: allowed values are finite numbers"),
        # an infinite band passes every candidate (and inf * SE 0 is a NaN band, which read as "better")
        (["precision=fp16", "--against", "bf16", "--sigmas", "inf"], "--sigmas=inf: allowed values are finite numbers"),
        (["precision=fp16", "--against", "bf16", "--tolerance", "inf"], "--tolerance=inf: allowed values are finite"),
        (["precision=fp16", "--against", "bf16", "--tolerance=-inf"], "--tolerance=-inf: allowed values are"),
        (["precision=fp16", "--against", "bf16", "--first-seed", "-1"], "--first-seed=-1: seeds are >= 0"),
        (["precision=fp16", "--against", "bf16", "seed=3"], "'seed=3': the gate sets seed itself"),
        (["precision=fp16", "--against", "bf16", "hydra.run.dir=x"], "the gate sets hydra.run.dir itself"),
        (["precision=fp16", "--against", "bf16", "recipe"], "'recipe' is not a Hydra override (KEY=VALUE)"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_them(tmp_path, capsys, argv, message):
    assert main([*argv, "--dir", str(tmp_path / "g")]) == 2
    line = _error(capsys)
    assert line.startswith("amp-gate: error: ") and message in line
    assert not (tmp_path / "g").exists()  # nothing trained or written


@pytest.mark.slow
def test_overrides_that_do_not_compose_or_are_rejected_exit_2_before_training(tmp_path, capsys):
    assert main(["precision=fp16", "--against", "bf16", "recipe=nope", "--dir", str(tmp_path)]) == 2
    line = _error(capsys)
    assert "the overrides do not compose for precision=bf16" in line and "recipe" in line and "nope" in line
    assert main(["precision=fp16", "--against", "bf16", "trainer.max_steps=-5", "--dir", str(tmp_path)]) == 2
    line = _error(capsys)
    assert line.startswith("amp-gate: error: precision=bf16: ") and "trainer.max_steps" in line
    assert list(tmp_path.iterdir()) == []


def _fake_runs(monkeypatch, losses: dict[str, list[float]], fail: str | None = None) -> list[tuple[str, int]]:
    """Replace training with summaries holding ``losses[preset][seed]``; record what was asked for."""
    asked: list[tuple[str, int]] = []

    def run_one(cfg, out, fresh):
        preset, seed = cfg.precision.precision, cfg.seed
        asked.append((preset, seed))
        if preset == fail:
            raise FloatingPointError("the weights became non-finite at step 3")
        bpp = {"params": 10, "weights": 2.0, "grads": 2.0, "master": 4.0, "master_grads": 0.0, "moments": 8.0}
        return {
            "status": "ok",
            "steps": 4,
            "skipped_steps": seed % 2,
            "wall_time_s": 1.0,
            "final_metrics": {"train/loss": 9.0, "val/loss": losses[preset][seed], "val/acc": 0.5},
            "bytes_per_param": {**bpp, "total": 16.0},
            "reused": False,
        }

    monkeypatch.setattr(gate, "_run_one", run_one)
    return asked


@pytest.mark.slow
def test_within_noise_exits_0_and_writes_the_report(tmp_path, monkeypatch, capsys):
    asked = _fake_runs(monkeypatch, {"bf16": [1.0, 2.0, 3.0, 4.0], "bf16_split": [1.1, 1.9, 3.2, 4.1]})
    status = main(["precision=bf16_split", "--against", "bf16", "--seeds", "4", *TINY, "--dir", str(tmp_path)])
    assert status == 0
    assert asked == [(p, s) for s in range(4) for p in ("bf16", "bf16_split")]  # paired, reference first
    report = json.loads((tmp_path / "gate-bf16_split-vs-bf16.json").read_text())
    assert report["verdict"] == "within noise" and report["exit_status"] == 0 and report["seeds"] == [0, 1, 2, 3]
    loss = report["metrics"][0]
    assert loss["metric"] == "val/loss" and loss["diff"] == pytest.approx(0.075)  # d = [.1, -.1, .2, .1]
    assert loss["se"] == pytest.approx(math.sqrt(0.0475 / 3) / 2)
    assert [m["metric"] for m in report["metrics"]] == ["val/loss", "val/acc"]
    assert report["sides"]["bf16_split"]["skipped_steps"] == [0, 1, 0, 1]
    assert report["sides"]["bf16"]["bytes_per_param"]["total"] == 16.0
    out = capsys.readouterr().out
    assert "verdict: within noise (exit 0)" in out and "16.00 bytes/param" in out
    assert re.search(r"val/loss +2\.575 +2\.5 +\+0\.075 +0\.06292 +0\.1258 +within noise", out)
    log = tmp_path / "gate-bf16_split-vs-bf16.log"
    assert out.startswith(f"amp-gate: 8 runs of bf16 and bf16_split; their output goes to {log}\n")
    assert [line for line in out.splitlines() if line.startswith("  seed")] == [
        f"  seed {s}: bf16 1.0 s, bf16_split 1.0 s" for s in range(4)
    ]
    assert len(out.splitlines()) == 1 + 4 + 11  # the log's name, a line per seed, the report


@pytest.mark.slow
def test_worse_exits_1_and_says_by_how_much(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, {"bf16": [1.0, 1.2], "bf16_autocast": [1.1, 1.35]})  # d = [.1, .15]: SE 0.025
    assert main(["precision=bf16_autocast", "--against", "bf16", "--seeds", "2", *TINY, "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "worse by 0.125 (+11.36%, 5.0 SE)" in out and "verdict: worse (exit 1)" in out
    # a tolerance wider than the difference accepts it
    json_path = tmp_path / "tolerant.json"
    argv = ["precision=bf16_autocast", "--against", "bf16", "--seeds", "2", "--tolerance", "0.15", *TINY]
    assert main([*argv, "--dir", str(tmp_path), "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["metrics"][0]["band"] == pytest.approx(0.165)


@pytest.mark.slow
def test_equal_paired_differences_give_no_verdict_without_a_tolerance(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, {"bf16": [1.0, 2.0], "bf16_autocast": [1.5, 2.5]})  # d = [.5, .5]: SE 0
    assert main(["precision=bf16_autocast", "--against", "bf16", "--seeds", "2", *TINY, "--dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gate-bf16_autocast-vs-bf16.json").read_text())
    assert report["verdict"] == "undecided" and report["exit_status"] == 1
    assert "standard error is 0" in report["error"] and "--tolerance" in report["error"]
    out = capsys.readouterr().out
    assert "verdict: undecided (exit 1)" in out
    # with a tolerance the band is not 0: a verdict again
    argv = ["precision=bf16_autocast", "--against", "bf16", "--seeds", "2", "--tolerance", "0.5", *TINY]
    assert main([*argv, "--dir", str(tmp_path)]) == 0


def test_a_json_path_that_is_a_directory_exits_2_before_training(tmp_path, monkeypatch, capsys):
    asked = _fake_runs(monkeypatch, {"bf16": [1.0, 2.0], "fp16": [1.0, 2.0]})
    (tmp_path / "taken").mkdir()
    argv = ["precision=fp16", "--against", "bf16", "--seeds", "2", "--json", str(tmp_path / "taken")]
    assert main([*argv, "--dir", str(tmp_path / "g")]) == 2
    line = _error(capsys)
    assert f"--json={tmp_path / 'taken'} is a directory" in line
    assert asked == [] and not (tmp_path / "g").exists()


def test_a_dir_with_a_space_and_a_comma_works(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, {"bf16": [1.0, 2.0], "fp16": [1.0, 2.1]})
    spaced = tmp_path / "my gate, v2"  # a space and a comma (Hydra reads an unquoted comma as a sweep)
    assert main(["precision=fp16", "--against", "bf16", "--seeds", "2", *TINY, "--dir", str(spaced)]) in (0, 1)
    report = json.loads((spaced / "gate-fp16-vs-bf16.json").read_text())
    assert report["runs"][0]["dir"] == str(spaced / "bf16" / "seed0")


def _finished(out, cfg, summary: dict) -> None:
    """The files a finished gate run leaves (as :func:`gate._run_one` writes them)."""
    from amp_plugin.app import rundir

    out.mkdir(parents=True)
    rundir.write_run_id(out, "0123456789abcdef")
    text = json.dumps(summary) + "\n"
    (out / "summary.json").write_text(text)
    record = {"config": gate.reuse_key(cfg), "bytes_per_param": {"total": 16.0}}
    record["summary_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (out / "gate_run.json").write_text(json.dumps(record) + "\n")


@pytest.mark.parametrize("damage", ["none", "failed_note", "edited_summary"])
def test_a_run_is_reused_only_while_its_files_are_as_the_gate_left_them(tmp_path, monkeypatch, damage):
    import amp_plugin.app.run

    out = tmp_path / "bf16" / "seed0"
    cfg = gate.compose_run(TINY, "bf16", 0, out)
    _finished(out, cfg, {"status": "ok", "steps": 4, "final_metrics": {"val/loss": 1.0}})
    if damage == "failed_note":
        (out / "FAILED").write_text("RunFailed: the last 4 of its 4 steps were all skipped\n")
    elif damage == "edited_summary":
        (out / "summary.json").write_text(json.dumps({"status": "ok", "steps": 4, "final_metrics": {"val/loss": 0.1}}))

    class Trained(Exception):
        pass

    def train(cfg, settings=None, **kwargs):
        raise Trained

    monkeypatch.setattr(amp_plugin.app.run, "train", train)
    if damage == "none":
        assert gate._run_one(cfg, out, fresh=False)["reused"] is True
        return
    with pytest.raises(Trained):
        gate._run_one(cfg, out, fresh=False)


def test_the_gate_counts_bytes_with_the_run_summarys_accounting(tmp_path, monkeypatch):
    import types

    import torch

    import amp_plugin.app.run

    counted = {"params": 7, "weights": 2.0, "grads": 2.0, "master": 4.0, "master_grads": 0.0, "moments": 2.0}
    counted["total"] = 10.0

    def train(cfg, settings=None, **kwargs):
        module = torch.nn.Linear(3, 3)
        trainer = types.SimpleNamespace(optimizers=[torch.optim.AdamW(module.parameters())])
        summary = {"status": "ok", "steps": 4, "state_bytes_per_param": counted}
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "summary.json").write_text(json.dumps(summary))
        return {**summary, "module": module, "trainer": trainer, "plugin": None}

    monkeypatch.setattr(amp_plugin.app.run, "train", train)
    out = tmp_path / "bf16" / "seed0"
    run = gate._run_one(gate.compose_run(TINY, "bf16", 0, out), out, fresh=True)
    assert run["bytes_per_param"] == counted  # the summary's state_bytes.per_parameter, not a second count


@pytest.mark.slow
def test_a_failed_run_fails_the_gate(tmp_path, monkeypatch, capsys):
    asked = _fake_runs(monkeypatch, {"bf16": [1.0, 1.0, 1.0]}, fail="fp16")
    assert main(["precision=fp16", "--against", "bf16", "--seeds", "3", *TINY, "--dir", str(tmp_path)]) == 1
    assert asked == [("bf16", 0), ("fp16", 0)]  # stops at the first failure
    report = json.loads((tmp_path / "gate-fp16-vs-bf16.json").read_text())
    assert report["verdict"] == "failed" and report["exit_status"] == 1
    assert "precision=fp16 seed=0" in report["error"] and "FloatingPointError" in report["error"]
    log = tmp_path / "gate-fp16-vs-bf16.log"
    assert f"(traceback in {log})" in report["error"] and report["log"] == str(log)
    assert "Traceback (most recent call last)" in log.read_text() and "at step 3" in log.read_text()
    out = capsys.readouterr().out
    assert "verdict: failed (exit 1)" in out and "  seed 0: bf16 1.0 s, fp16 failed\n" in out


@pytest.mark.slow
def test_no_judged_metric_fails_the_gate(tmp_path, monkeypatch):
    _fake_runs(monkeypatch, {"bf16": [1.0, 1.0], "fp16": [1.0, 1.0]})
    monkeypatch.setattr(gate, "DIRECTIONS", {"val/ppl": "lower"})
    assert main(["precision=fp16", "--against", "bf16", "--seeds", "2", *TINY, "--dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gate-fp16-vs-bf16.json").read_text())
    assert report["verdict"] == "failed" and "none of the judged metrics (val/ppl)" in report["error"]


@pytest.mark.slow
def test_a_small_gate_end_to_end_trains_paired_seeds_and_reuses_finished_runs(tmp_path, capsys):
    argv = ["precision=bf16_split", "--against", "bf16", "--seeds", "2", *TINY, "--dir", str(tmp_path)]
    status = main(argv)
    report = json.loads((tmp_path / "gate-bf16_split-vs-bf16.json").read_text())
    assert status == (1 if report["verdict"] == "worse" else 0) and report["verdict"] != "failed"
    runs = report["runs"]
    assert [(r["preset"], r["seed"], r["status"], r["reused"]) for r in runs] == [
        ("bf16", 0, "ok", False),
        ("bf16_split", 0, "ok", False),
        ("bf16", 1, "ok", False),
        ("bf16_split", 1, "ok", False),
    ]
    for r in runs:
        assert r["steps"] == 4 and r["skipped_steps"] == 0
        summary = json.loads((tmp_path / r["preset"] / f"seed{r['seed']}" / "summary.json").read_text())
        assert summary["seed"] == r["seed"] and summary["precision"] == r["preset"]
        assert summary["final_metrics"]["val/loss"] == r["final_metrics"]["val/loss"]
    # the BF16 weights and gradients, the masters (FP32, or the 16-bit remainders), AdamW's state
    split, ref = report["sides"]["bf16_split"]["bytes_per_param"], report["sides"]["bf16"]["bytes_per_param"]
    assert 8.0 < ref["moments"] < 8.1 and split["moments"] == ref["moments"]  # two FP32 moments + step counters
    assert ref["master"] > 3.0 and split["master"] == pytest.approx(
        ref["master"] / 2, abs=0.05
    )  # + 4-byte placeholders per tensor
    assert ref["total"] - split["total"] == pytest.approx(ref["master"] / 2, abs=0.05)
    assert [m["metric"] for m in report["metrics"]] == ["val/loss", "val/acc"]
    first = capsys.readouterr()
    assert "verdict: " in first.out and "bytes/param" in first.out and first.err == ""
    # what the runs print (Lightning's banners, the run summaries) is in the log, not on the console
    assert "run summary" not in first.out and "GPU available" not in first.out + first.err
    log = (tmp_path / "gate-bf16_split-vs-bf16.log").read_text()
    assert log.count("amp_plugin run summary") == 4 and "GPU available" in log
    # the same gate again: every run is reused, and the report is the same
    assert main(argv) == status
    again = json.loads((tmp_path / "gate-bf16_split-vs-bf16.json").read_text())
    assert all(r["reused"] for r in again["runs"]) and again["metrics"] == report["metrics"]
    assert "  seed 1: bf16 reused, bf16_split reused\n" in capsys.readouterr().out
    # precision.moments_rounding does nothing where the moments are FP32 (bf16, bf16_split): those runs
    # are reused; bf16_lean's BF16 moments are rounded by it, so its runs are not
    for n, extra in enumerate([[], ["precision.moments_rounding=nearest"]]):
        json_path = tmp_path / f"rounding{n}.json"
        assert main([*argv, *extra, "--json", str(json_path)]) in (0, 1)
        runs = json.loads(json_path.read_text())["runs"]
        assert [(r["preset"], r["reused"]) for r in runs] == [("bf16", True), ("bf16_split", True)] * 2
        lean = [o.replace("precision=bf16_split", "precision=bf16_lean") for o in argv]
        assert main([*lean, *extra, "--json", str(json_path)]) in (0, 1)
        runs = json.loads(json_path.read_text())["runs"]
        assert [(r["preset"], r["reused"]) for r in runs] == [("bf16", True), ("bf16_lean", False)] * 2
    # a changed override trains again
    longer = [o.replace("max_steps=4", "max_steps=5") for o in argv]
    assert main(longer) in (0, 1)
    third = json.loads((tmp_path / "gate-bf16_split-vs-bf16.json").read_text())
    assert not any(r["reused"] for r in third["runs"]) and {r["steps"] for r in third["runs"]} == {5}
