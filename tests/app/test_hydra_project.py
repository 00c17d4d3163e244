"""amp_plugin dropped into a lightning-hydra-template-style project (``tests/hydra_project``).

The project knows nothing of amp_plugin apart from two config files: the plugin under
``trainer.plugins`` and its callbacks in the ``callbacks`` group, exactly as the README's
"From your own Hydra project" shows them (checked below). Its module holds torchmetrics
metrics, logs to CSV and TensorBoard at once, and resumes with ``ckpt_path=``.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from amp_plugin.settings import PRESETS

PROJECT = Path(__file__).resolve().parents[1] / "hydra_project"
README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*ckpt_path.*callbacks used to create the checkpoint.*"),
    pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended.*"),
]


def readme_yaml_blocks() -> list[str]:
    """The ``yaml`` blocks of the README section "From your own Hydra project"."""
    text = README.read_text()
    section = text.split("## From your own Hydra project", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, flags=re.S)


def test_the_readme_shows_exactly_the_configs_this_project_uses():
    blocks = readme_yaml_blocks()
    trainer = (PROJECT / "configs" / "trainer" / "default.yaml").read_text()
    callbacks = (PROJECT / "configs" / "callbacks" / "amp.yaml").read_text()
    assert blocks[0].split("\n", 1)[1] == trainer  # first line: "# configs/trainer/default.yaml"
    assert blocks[1].split("\n", 1)[1] == callbacks


def run(out: Path, *overrides: str):
    if str(PROJECT) not in sys.path:
        sys.path.insert(0, str(PROJECT))
    from src.train import train

    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"paths.output_dir={out}",
                "+trainer.log_every_n_steps=1",
                "+trainer.enable_progress_bar=false",
                *overrides,
            ],
        )
    _, trainer = train(cfg)
    return trainer


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def tensorboard_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = log_dir.glob("**/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_template_project_trains_logs_and_resumes_under_every_preset(tmp_path, preset):
    scaled = preset.startswith("fp16")
    overrides = [f"trainer.plugins.0.precision={preset}", "data.n=256"]  # 6 steps per epoch
    if scaled:  # one overflow before the checkpoint, one after
        overrides += [
            "+callbacks.fault._target_=amp_plugin.lightning.FaultInjector",
            "+callbacks.fault.inject_inf_at=[4,9]",
        ]
    if preset == "fp16_pure":  # Adam's eps=1e-8 is 0 in FP16 state: NaN weights (PreflightChecks says so)
        overrides += ["+model.optimizer.eps=1e-4"]

    first = run(tmp_path / "a", *overrides, "+trainer.max_steps=6")
    scaler = first.precision_plugin.scaler
    assert first.global_step == 6
    assert all(torch.isfinite(p).all() for p in first.lightning_module.parameters())
    metrics = read_csv(tmp_path / "a" / "csv" / "version_0" / "metrics.csv")
    assert len([r for r in metrics if r.get("train/loss")]) == 6
    tags = tensorboard_tags(tmp_path / "a" / "tensorboard")
    assert "train/loss" in tags
    if scaled:
        assert len([r for r in metrics if r.get("amp/loss_scale")]) == 6
        assert {"amp/loss_scale", "amp/skipped_steps"} <= tags
        events_a = read_csv(tmp_path / "a" / "csv" / "version_0" / "scale_events.csv")
        assert any(e["step"] == "4" for e in events_a)
        scale_a, skipped_a = scaler.get_scale(), scaler.skipped_steps
        assert skipped_a >= 1
    else:
        assert not scaler.is_enabled()

    second = run(
        tmp_path / "b", *overrides, "+trainer.max_steps=12", f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}"
    )
    assert second.global_step == 12
    resumed = second.precision_plugin.scaler
    if scaled:
        events_b = read_csv(tmp_path / "b" / "csv" / "version_0" / "scale_events.csv")
        assert events_b[: len(events_a)] == events_a  # the history continues...
        assert any(e["step"] == "9" for e in events_b[len(events_a) :])  # ...and so does the run
        assert resumed.skipped_steps == skipped_a + len(
            [e for e in events_b[len(events_a) :] if e["reason"] != "growth"]
        )
        metrics_b = read_csv(tmp_path / "b" / "csv" / "version_0" / "metrics.csv")
        first_scale = next(float(r["amp/loss_scale"]) for r in metrics_b if r.get("amp/loss_scale"))
        assert first_scale == scale_a  # the scale continues from the checkpoint
    else:
        assert not resumed.is_enabled()
