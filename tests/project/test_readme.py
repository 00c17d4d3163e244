"""The README's Python examples run as written (with a small model and data put in their namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _models import TinyClassifier, as_lightning
from torch import nn

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
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
def test_the_lightning_example_runs(package, tmp_path):
    pl = pytest.importorskip(f"{package}.pytorch" if package == "lightning" else package)
    code = block('MixedPrecisionPlugin("fp16"')
    if package == "pytorch_lightning":  # the comment's alternative
        code = code.replace("import lightning as L", "import pytorch_lightning as L")
    code = code.replace(
        "L.Trainer(",
        f"L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, default_root_dir={str(tmp_path)!r}, "
        "enable_progress_bar=False, enable_model_summary=False, ",
    )
    model = as_lightning(pl, TinyClassifier)()
    namespace = {"model": model}
    exec(code, namespace)
    assert namespace["trainer"].global_step == 3
    assert namespace["plugin"].scaler.hysteresis == 2


def test_the_docs_name_tests_and_files_that_exist():
    """Every ``tests/...py::test_name`` and every tests/ or benchmarks/ file the docs cite is there."""
    root = Path(__file__).resolve().parents[2]
    pages = [root / name for name in ("README.md", "BENCHMARKS.md", "RELIABILITY.md")] + sorted(
        (root / "docs").glob("*.md")
    )
    docs = "".join(page.read_text() for page in pages)
    cited = re.findall(r"(tests/[\w/]+\.py)::(\w+)", docs)
    assert len(cited) > 20  # the Guarantees table names its tests
    missing = [
        f"{path}::{name}"
        for path, name in cited
        if not (root / path).is_file() or f"def {name}(" not in (root / path).read_text()
    ]
    missing += [
        path
        for path in set(re.findall(r"((?:tests|benchmarks)/[\w/]+\.(?:py|txt|json))", docs))
        if not (root / path).is_file()
    ]
    assert not missing


def section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_the_start_here_numbers_are_the_benchmarks_and_the_first_run_times_are_runs_md():
    """Every number the README's preset advice quotes is one BENCHMARKS.md reports; the first-run
    times are the ones docs/runs.md measured (with the machine beside them)."""
    root = Path(__file__).resolve().parents[2]
    benchmarks = (root / "BENCHMARKS.md").read_text()
    advice = section(README, "## Start here: which preset")
    quoted = re.findall(r"\d+\.\d+", advice)
    assert len(quoted) >= 15
    assert [n for n in quoted if n not in benchmarks] == []
    runs = (root / "docs" / "runs.md").read_text()
    first_run = section(README, "## The first run")
    times = re.findall(r"(\d+(?:\.\d+)?(?:-\d+\.\d+)?) s\b", first_run.split("```", 2)[2])
    assert {"98", "74", "22.6-22.9", "75"} <= set(times)
    assert all(f"{t} s" in runs for t in times), times
    assert "AMD EPYC" in first_run and "avx2 fma f16c" in runs


def test_the_hydra_projects_trainer_config_names_every_preset():
    from amp_plugin.settings import PRESETS

    trainer = Path(__file__).resolve().parents[1] / "hydra_project" / "configs" / "trainer"
    config = (trainer / "default.yaml").read_text()
    comment = config.split("precision: fp16", 1)[1].split("scaler:", 1)[0]
    named = {word.strip() for word in re.split(r"[|:#\s]+", comment) if word.strip()} - {"a", "preset"}
    assert named == set(PRESETS)
