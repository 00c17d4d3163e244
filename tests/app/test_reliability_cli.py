"""Faults, a collapsing loss scale, non-finite weights, changed setups on resume and bad input, through ``train.py``.

Every command line below goes through train.py's real entry point (``@hydra.main`` ->
``run_job``), all of them in ONE subprocess (``_cli_batch.run_batch``), so the table costs one torch and
Lightning import instead of one per row. The runs depend on each other in order: the
collapse run's ``last-good.ckpt`` is resumed in bf16, the fault run's checkpoint is resumed
with other scaler settings and is truncated into a corrupt ``ckpt_path``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from _cli_batch import run_batch
from omegaconf import OmegaConf

# Every test here reads the runs of one batch of CLI processes (a few minutes on 2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reliability_cli")]

QUICK = ["trainer.enable_progress_bar=false", "trainer.limit_val_batches=1", "plot=false"]
FAULTS = [
    "+fault.inject_inf_at=[3,7]",
    "+fault.inject_nan_at=[10]",
    "+fault.nan_loss_at=[5]",
    "+fault.nan_input_at=[9]",
    "+fault.param=net.4.weight",
]
COLLAPSE = ["+fault.inject_inf_from=2", "scaler.init_scale=4", "scaler.min_scale=1"]

# name -> command line. Runs whose names start with "bad:" must be rejected before training.
RUNS: dict[str, list[str]] = {
    "faults": [*FAULTS, "trainer.max_steps=12", "trainer.log_every_n_steps=1", *QUICK],
    # The collapse runs without their faults, stopped before the first one (steps 0 and 1).
    "two_steps": ["scaler.init_scale=4", "scaler.min_scale=1", "trainer.max_steps=2", *QUICK],
    "collapse": [*COLLAPSE, "trainer.max_steps=20", *QUICK],
    "collapse_skip": [*COLLAPSE, "scaler.on_min_scale=skip", "trainer.max_steps=8", *QUICK],
    "resume_bf16": ["precision=bf16", "ckpt_path=collapse/checkpoints/last-good.ckpt", "trainer.max_steps=8", *QUICK],
    "resume_new_scaler_settings": [
        "scaler.growth_interval=50",
        "ckpt_path=faults/checkpoints/last.ckpt",
        "trainer.max_steps=14",
        *QUICK,
    ],
    "resume_static_scaler": ["scaler=static", "ckpt_path=faults/checkpoints/last.ckpt", "trainer.max_steps=14", *QUICK],
    # No scaler to skip it: a NaN loss at step 3 poisons the weights; checkpoints every 2 steps.
    "nan_fp32": [
        "precision=fp32",
        "+fault.nan_loss_at=[3]",
        "trainer.max_steps=10",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        *QUICK,
    ],
    # A NaN batch at the last step: skipped, but the logged train/loss is NaN.
    "nan_last_step": ["+fault.nan_input_at=[2]", "trainer.max_steps=3", *QUICK],
    # One overflow at step 1 (scale 4 -> 2), healthy saves at steps 5 and 10, then a collapse.
    "collapse_after_healthy": [
        "+fault.inject_inf_at=[1]",
        "+fault.inject_inf_from=12",
        "scaler.init_scale=4",
        "scaler.min_scale=1",
        "trainer.max_steps=30",
        "callbacks.recovery_checkpoint.every_n_steps=5",
        "callbacks.recovery_checkpoint.healthy_steps=3",
        *QUICK,
    ],
    "resume_recovery": [
        "scaler.init_scale=4",
        "ckpt_path=collapse_after_healthy/checkpoints/last-good.ckpt",
        "trainer.max_steps=14",
        *QUICK,
    ],
    "lr_base": ["trainer.max_steps=4", *QUICK],
    "resume_new_lr": [
        "recipe.lr=0.1",
        "recipe.weight_decay=0.01",
        "ckpt_path=lr_base/checkpoints/last.ckpt",
        "trainer.max_steps=6",
        *QUICK,
    ],
    "final_step": [
        "recipe=underflow_demo",
        "trainer.max_steps=7",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        *QUICK,
    ],
}

# Bad command lines (on top of tests/app/test_config_validation.py's table), then strings stderr
# must contain: the key, the value, what is allowed.
BAD = [
    (["+fault.inject_inf_at=abc"], ["fault.inject_inf_at", "abc", "ListConfig"]),
    (["+fault.inject_inf_at=[-1]"], ["fault.inject_inf_at=[-1]", "integers >= 0"]),
    (["+fault.nan_loss_at=[1.5]"], ["fault.nan_loss_at", "1.5", "Integer"]),
    (["+fault.inject_inf_from=-2"], ["fault.inject_inf_from=-2", "integer >= 0"]),
    (["+fault.rank=1", "+fault.inject_inf_at=[2]"], ["fault.rank=1", "1 process(es)", "[0, 0]"]),
    (["+fault.rank=-1", "+fault.inject_inf_at=[2]"], ["fault.rank=-1", "integer >= 0"]),
    (["+fault.param=nope", "+fault.inject_inf_at=[2]"], ["fault.param='nope'", "net.1.weight"]),
    (["+fault.bogus=1"], ["fault.bogus is not a setting of FaultInjector", "inject_inf_at"]),
    (["fault.bogus=1"], ["fault.bogus", "FaultConf"]),
    (["ckpt_path=truncated.ckpt"], ["ckpt_path='truncated.ckpt'", "cannot be read as a checkpoint", "truncated"]),
    (["ckpt_path=garbage.ckpt"], ["ckpt_path='garbage.ckpt'", "cannot be read as a checkpoint"]),
    (["ckpt_path=plain_tensors.ckpt"], ["ckpt_path='plain_tensors.ckpt'", "not a Lightning checkpoint"]),
    (["ckpt_path=faults"], ["ckpt_path='faults'", "a directory", "checkpoint file"]),
    (
        ["ckpt_path=faults/checkpoints/last.ckpt", "trainer.max_steps=5"],
        ["trainer.max_steps=5 leaves nothing to train", "already at step 12"],
    ),
    (["scaler.min_scale=0"], ["scaler.min_scale=0", "> 0"]),
    (["scaler.max_scale=inf"], ["scaler.max_scale=inf", "finite"]),
    (["scaler.on_min_scale=stop"], ["scaler.on_min_scale", "'stop'", "expected one of [raise, skip]"]),
    (["precision=bf16", "scaler.init_scale=8"], ["scaler.init_scale", "NoScalerConf"]),
    (
        ["precision=fp32", "scaler=dynamic"],
        ["scaler=DynamicLossScaler", "not allowed with precision='fp32'", "scaler=None"],
    ),
    (
        ["precision=fp16_pure", "precision.master_weights=true"],
        ["precision.master_weights=True contradicts precision='fp16_pure'", "precision='fp16'"],
    ),
    (
        ["precision=bf16_pure", "precision.autocast=true"],
        ["precision.autocast=True contradicts precision='bf16_pure'", "precision='bf16_autocast'"],
    ),
    (["precision=half"], ["precision/half", "bf16_autocast"]),
    (["trainer.max_steps=1.5"], ["trainer.max_steps", "1.5", "Integer"]),
    (["recipe.batch_size=big"], ["recipe.batch_size='big'", "an integer"]),
    (["recipe.batch_size=0"], ["recipe.batch_size=0", "integer >= 1"]),
    (["recipe.lr=-1"], ["recipe.lr=-1", "finite number > 0"]),
    (["recipe.lr=nan"], ["recipe.lr=nan", "finite number > 0"]),
    (
        ["recipe=underflow_demo", "ckpt_path=faults/checkpoints/last.ckpt", "trainer.max_steps=20"],
        [
            "ckpt_path='faults/checkpoints/last.ckpt' is not allowed: its weights do not fit",
            "UnderflowDemoRecipe",
            "unexpected net.1.weight",
            "trained with",
        ],
    ),
    (
        ["recipe.hidden_sizes=[64,64]", "ckpt_path=faults/checkpoints/last.ckpt", "trainer.max_steps=20"],
        ["its weights do not fit", "net.1.weight is [128, 64] there and [64, 64] here"],
    ),
    (
        ["recipe=char_gpt", "+fault.nan_input_at=[1]"],
        ["fault.nan_input_at=[1] is not allowed", "no floating-point tensor", "fault.nan_loss_at"],
    ),
]

# Found while Lightning sets the run up, before the first step: one message, no checkpoint or metric.
SETUP_BAD = [
    (
        ["trainer.val_check_interval=1000", "trainer.max_steps=5"],
        ["trainer.val_check_interval=1000 is not allowed", "number of the training batches (23)"],
    ),
    (
        ["recipe.optimizer=sgd", "ckpt_path=lr_base/checkpoints/last.ckpt", "trainer.max_steps=6"],
        ["cannot be resumed with recipe.optimizer='sgd' (the checkpoint's run had 'adamw')", "another optimizer"],
    ),
]

# Writes the checkpoint files the bad rows need, from the "faults" run before it.
_PREPARE = """
import os, torch
data = open("faults/checkpoints/last.ckpt", "rb").read()
open("truncated.ckpt", "wb").write(data[: len(data) // 2])
open("garbage.ckpt", "wb").write(os.urandom(4096))
torch.save({"weights": torch.zeros(3)}, "plain_tensors.ckpt")
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("reliability")
    ops = [{"kind": "run", "name": name, "args": args} for name, args in RUNS.items()]
    ops.append({"kind": "python", "code": _PREPARE})
    ops += [{"kind": "run", "name": f"bad{i}", "args": args} for i, (args, _) in enumerate(BAD)]
    ops += [{"kind": "run", "name": f"setup_bad{i}", "args": [*args, *QUICK]} for i, (args, _) in enumerate(SETUP_BAD)]
    return run_batch(work, ops)


def ok(result: dict) -> Path:
    assert result["code"] in (0, None), result["stderr"][-3000:]
    return Path(result["dir"])


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key


# ---------------------------------------------------------------------------------- faults
def test_injected_faults_are_skipped_counted_and_logged(runs):
    run = ok(runs["faults"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 12
    assert summary["skipped_steps"] == 5  # steps 3, 5, 7, 9, 10
    assert summary["loss_scale"]["end"] == 2.0**16 / 2**5 and summary["loss_scale"]["backoffs"] == 5
    assert summary["faults_injected"] == [
        [3, "inf_grad:net.4.weight"],
        [5, "nan_loss"],
        [7, "inf_grad:net.4.weight"],
        [9, "nan_input"],
        [10, "nan_grad:net.4.weight"],
    ]
    printed = runs["faults"]["stdout"]
    assert "skipped      5 of 12 steps" in printed and "faults       5 injected" in printed

    events = read_csv(run / "logs" / "scale_events.csv")
    assert [(int(e["step"]), e["reason"]) for e in events] == [(s, "overflow") for s in (3, 5, 7, 9, 10)]
    by_step = {int(e["step"]): e for e in events}
    for step in (3, 7, 10):  # one element of net.4.weight's gradient was written
        assert by_step[step]["nonfinite_params"] == "net.4.weight:1"
    for step in (5, 9):  # a NaN loss or input poisons every gradient
        assert "net.1.weight:" in by_step[step]["nonfinite_params"]

    # metrics.csv (log_every_n_steps=1): the cumulative count rises exactly at the faulty steps.
    rows = [r for r in read_csv(run / "logs" / "metrics.csv") if r["amp/skipped_steps"]]
    skipped = {int(r["step"]): float(r["amp/skipped_steps"]) for r in rows}
    assert [skipped[s] for s in range(12)] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 5]


def test_persistent_overflow_stops_cleanly_with_the_last_good_state_saved(runs):
    result = runs["collapse"]
    assert result["code"] == 1
    run, stderr = Path(result["dir"]), result["stderr"]
    checkpoint = run / "checkpoints" / "last-good.ckpt"
    # 4 -> 2 at step 2, 2 -> 1 at step 3, and at step 4 the scale has nowhere left to go.
    assert (
        "Training stopped: Loss scale collapsed: gradients are still inf/NaN at the minimum scale 1 "
        "(step 4, 3 steps skipped in a row)"
    ) in stderr
    assert "Try: a lower learning rate" in stderr and "on_min_scale='skip'" in stderr
    assert f"The last healthy state is in {checkpoint}." in stderr
    assert "It holds step 0, the last healthy state; resuming from it restarts the loss scale" in stderr
    assert f"ckpt_path={checkpoint} hydra.run.dir={run}" in stderr  # the command that resumes from it
    assert "Traceback" not in stderr and "HYDRA_FULL_ERROR=1" in stderr
    assert "FAILED" in result["listing"] and "summary.json" not in result["listing"]
    assert "LossScaleCollapseError" in (run / "FAILED").read_text()
    assert not (run / "training_curves.csv").exists()

    # Not the collapsed state (step 4, scale 1, 3 skips in a row): the state training started from,
    # since no periodic healthy save (every 50 steps) came before the collapse.
    saved = load(checkpoint)
    assert saved["global_step"] == 0 and saved["amp_plugin_recovery"]["reason"] == "start"
    assert saved["amp_plugin"]["scaler"]["scale"] == 4.0 and saved["amp_plugin"]["scaler"]["skipped_steps"] == 0


def test_on_min_scale_skip_keeps_going_and_then_fails_the_run(runs):
    result = runs["collapse_skip"]
    run = Path(result["dir"])
    # It goes on to the last step, but a run whose last 6 of 8 steps were skipped did not train.
    assert result["code"] == 1 and "Training stopped: the last 6 of its 8 steps were all skipped" in result["stderr"]
    assert "were all skipped" in (run / "FAILED").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "every step from step 2 on overflowed" in summary["failure"]
    assert summary["global_step"] == 8 and summary["skipped_steps"] == 6 and summary["loss_scale"]["end"] == 1.0
    events = read_csv(run / "logs" / "scale_events.csv")
    assert [e["reason"] for e in events] == ["overflow", "overflow"] + ["min_scale"] * 4
    # Six skipped steps later the weights are still those after step 1.
    before = load(ok(runs["two_steps"]) / "checkpoints" / "last.ckpt")
    assert_same_weights(load(run / "checkpoints" / "last.ckpt"), before)


# ---------------------------------------------------------------------------------- resume with another setup
def test_resuming_the_collapsed_run_in_bf16_warns_on_the_console(runs):
    result = runs["resume_bf16"]
    run = ok(result)
    assert (
        "Resuming with a different mixed-precision setup (precision: checkpoint 'fp16', now 'bf16', "
        "scaler_type: checkpoint 'DynamicLossScaler', now None)"
    ) in result["stderr"]
    assert "loss-scaler state is not restored" in result["stderr"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == "collapse/checkpoints/last-good.ckpt"
    assert (summary["global_step"], summary["steps"], summary["scaler"]) == (8, 8, "none")
    assert "resumed at step 0" in result["stdout"]


def test_resuming_with_other_scaler_settings_warns_and_continues_the_scale(runs):
    result = runs["resume_new_scaler_settings"]
    summary = json.loads((ok(result) / "summary.json").read_text())
    assert "Loss-scaler settings changed since the checkpoint (growth_interval: 2000 -> 50)" in result["stderr"]
    assert summary["loss_scale"]["start"] == 2.0**11  # where the fault run ended, not init_scale

    result = runs["resume_static_scaler"]
    summary = json.loads((ok(result) / "summary.json").read_text())
    assert "scaler_type: checkpoint 'DynamicLossScaler', now 'StaticLossScaler'" in result["stderr"]
    assert summary["loss_scale"]["start"] == 2.0**16  # the static scale: the dynamic state is not reused


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("index", range(len(BAD)), ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_never_starts_a_run(runs, index):
    result, expected = runs[f"bad{index}"], BAD[index][1]
    stderr = result["stderr"]
    assert result["code"] not in (0, None)
    for part in expected:
        assert part in stderr
    assert "Traceback" not in stderr + result["stdout"] and "HYDRA_FULL_ERROR=1" in stderr
    assert len(stderr.split("\n\n")) <= 4  # a paragraph or two (Hydra adds a search-path block), not a wall
    if result["listing"] is not None:  # Hydra made the directory: nothing in it looks like a run
        assert not set(result["listing"]) & {"checkpoints", "logs", "summary.json", "training_curves.csv"}
        assert "FAILED" in result["listing"]


@pytest.mark.parametrize("index", range(len(SETUP_BAD)), ids=[" ".join(a) for a, _ in SETUP_BAD])
def test_bad_input_found_at_setup_stops_before_the_first_step(runs, index):
    result, expected = runs[f"setup_bad{index}"], SETUP_BAD[index][1]
    stderr = result["stderr"]
    assert result["code"] == 1
    assert "Invalid configuration: " in stderr, stderr[-3000:]
    for part in expected:
        assert part in stderr
    assert "Traceback" not in stderr + result["stdout"]
    run = Path(result["dir"])
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert not (run / "logs" / "metrics.csv").exists() and "summary.json" not in result["listing"]


# ---------------------------------------------------------------------------------- non-finite values
def strict_json(path: Path) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_nan_weights_without_a_scaler_stop_the_run_and_keep_finite_checkpoints(runs):
    result = runs["nan_fp32"]
    run = Path(result["dir"])
    assert result["code"] == 1
    stderr = result["stderr"]
    assert "Training stopped: Non-finite values at step 3: the weights are no longer finite" in stderr
    assert "precision=fp32 no loss scaler skips such a step" in stderr and "recipe.lr" in stderr
    assert "Traceback" not in stderr and "summary.json" not in result["listing"]
    assert "NonFiniteError" in (run / "FAILED").read_text()
    checkpoints = sorted((run / "checkpoints").glob("*.ckpt"))
    assert [load(p)["global_step"] for p in checkpoints] == [2, 2]  # epoch0-step2.ckpt, last.ckpt
    for path in checkpoints:
        assert all(torch.isfinite(t).all() for t in load(path)["state_dict"].values()), path


def test_summary_json_is_strict_json_with_a_note_for_each_nan(runs):
    result = runs["nan_last_step"]  # a NaN final loss: the run failed, and says so in a strict summary.json
    assert result["code"] == 1 and "non-finite" in result["stderr"]
    summary = strict_json(Path(result["dir"]) / "summary.json")
    assert summary["status"] == "failed" and "non-finite" in summary["failure"]
    assert summary["final_metrics"]["train/loss"] is None
    assert "final_metrics.train/loss was nan (written as null)" in summary["notes"]


# ---------------------------------------------------------------------------------- recovery
def test_the_recovery_checkpoint_is_the_last_healthy_state_and_restarts_the_scale(runs):
    result = runs["collapse_after_healthy"]
    assert result["code"] == 1 and "Loss scale collapsed" in result["stderr"]
    run = Path(result["dir"])
    saved = load(run / "checkpoints" / "last-good.ckpt")
    # Not the collapsed state (step 13, scale 1, two skips in a row): the healthy save at step 10.
    assert saved["global_step"] == 10 and saved["amp_plugin_recovery"]["reason"] == "healthy"
    assert saved["amp_plugin"]["scaler"]["scale"] == 2.0 and saved["amp_plugin"]["scaler"]["consecutive_skips"] == 0

    resumed = runs["resume_recovery"]
    summary = json.loads((ok(resumed) / "summary.json").read_text())
    assert (
        "collapse_after_healthy/checkpoints/last-good.ckpt is a recovery checkpoint, so the loss scale "
        "restarts at scaler.init_scale=4 (it was 2 there)"
    ) in resumed["stdout"]
    assert summary["loss_scale"]["start"] == 4.0 and summary["global_step"] == 14


def test_changed_optimizer_settings_on_resume_are_applied_and_logged(runs):
    result = runs["resume_new_lr"]
    run = ok(result)
    printed = result["stdout"]
    assert "amp_plugin: resume: recipe.lr=0.1 (the checkpoint's run had 0.003): applied to the optimizer" in printed
    assert "recipe.weight_decay=0.01 (the checkpoint's run had 0.0001): applied to the optimizer" in printed
    group = load(run / "checkpoints" / "last.ckpt")["optimizer_states"][0]["param_groups"][0]
    assert (group["lr"], group["weight_decay"]) == (0.1, 0.01)
    recorded = OmegaConf.load(run / ".hydra" / "config.yaml").recipe  # what ran is what is recorded
    assert (recorded.lr, recorded.weight_decay) == (0.1, 0.01)


def test_the_last_checkpoint_is_at_the_final_step(runs):
    run = ok(runs["final_step"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 7
    assert load(Path(summary["paths"]["last_checkpoint"]))["global_step"] == 7
    assert load(run / "checkpoints" / "epoch0-step6.ckpt")["global_step"] == 6


# ---------------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(inject_inf_at=[-1]), r"inject_inf_at=\[-1\] is not allowed"),
        (dict(nan_input_at=[2.0]), r"nan_input_at=\[2.0\] is not allowed"),
        (dict(inject_inf_from=-1), r"inject_inf_from=-1 is not allowed: .* integer >= 0"),
        (dict(rank=True), r"rank=True is not allowed"),
        (dict(param=""), r"param='' is not allowed"),
    ],
)
def test_fault_injector_rejects_bad_arguments(kwargs, match):
    from amp_plugin.callbacks import FaultInjector

    with pytest.raises(ValueError, match=match):
        FaultInjector(**kwargs)


def test_fault_injector_for_a_missing_rank_fails_before_the_first_step(pl):
    from _models import TinyClassifier, as_lightning, quiet_trainer

    from amp_plugin import MixedPrecisionPlugin
    from amp_plugin.callbacks import FaultInjector

    trainer = quiet_trainer(
        pl, plugins=[MixedPrecisionPlugin("fp16")], max_steps=3, callbacks=[FaultInjector(inject_inf_at=[0], rank=1)]
    )
    with pytest.raises(ValueError, match=r"rank=1 is not allowed: the run has 1 process\(es\)"):
        trainer.fit(as_lightning(pl, TinyClassifier)())
    assert trainer.global_step == 0
