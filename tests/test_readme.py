"""The README's Python examples run as written (with a small model and data put in their namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _models import TinyClassifier, as_lightning
from torch import nn

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def block(containing: str) -> str:
    found = [b for b in BLOCKS if containing in b]
    assert len(found) == 1, f"expected one README python block with {containing!r}"
    return found[0]


def test_the_plain_loop_trains_and_holds_the_schedule_on_skipped_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    xs, ys = torch.randn(64, 8), torch.randint(0, 3, (64,))
    loader = [(xs[i : i + 16], ys[i : i + 16]) for i in range(0, 64, 16)] * 3
    loader[2] = (torch.full_like(xs[:16], float("inf")), ys[:16])  # one batch overflows: that step is skipped
    namespace = {"model": model, "loader": loader, "loss_fn": nn.functional.cross_entropy}
    exec(block("for x, y in loader:"), namespace)
    scaler, sched, opt = namespace["scaler"], namespace["sched"], namespace["opt"]
    assert scaler.skipped_steps == 1
    assert sched.last_epoch == len(loader) - 1  # the skipped step did not advance the schedule
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert all(m.dtype == torch.float32 and torch.isfinite(m).all() for m in opt.master_params())


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_the_lightning_example_runs(package):
    pl = pytest.importorskip(f"{package}.pytorch" if package == "lightning" else package)
    code = block('MixedPrecisionPlugin("fp16"')
    if package == "pytorch_lightning":  # the comment's alternative
        code = code.replace("import lightning as L", "import pytorch_lightning as L")
    code = code.replace(
        "L.Trainer(",
        "L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, "
        "enable_progress_bar=False, enable_model_summary=False, ",
    )
    model = as_lightning(pl, TinyClassifier)()
    namespace = {"model": model}
    exec(code, namespace)
    assert namespace["trainer"].global_step == 3
    assert namespace["plugin"].scaler.hysteresis == 2
