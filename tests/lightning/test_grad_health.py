"""GradientHealthMonitor: planted tiny gradients underflow at scale 1 and not at 2**16; headroom; cost."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from _models import as_lightning
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import DynamicLossScaler
from amp_plugin.callbacks import GradientHealthMonitor
from amp_plugin.lightning.callbacks import grad_health
from amp_plugin.lightning.namespace import Callback
from amp_plugin.lightning.plugin import MixedPrecisionPlugin
from amp_plugin.master_weights import MasterWeightOptimizer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]

TINY = 1e-7


class Planted:
    """``big`` gets ordinary gradients; ``tiny.weight`` gets exactly ``TINY`` per element."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Linear(4, 2)
        self.tiny = nn.Linear(8, 1, bias=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        mse = ((self.big(x).float() - y.float()) ** 2).mean()
        ones = torch.ones(x.shape[0], 8, dtype=x.dtype)
        return mse + TINY * self.tiny(ones).float().mean()  # d/d(tiny.weight) = TINY

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)), batch_size=4)


class GradCapture(Callback):
    """Keeps a copy of the gradients the optimizer is about to use, by model parameter name."""

    def __init__(self):
        self.grads = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = (
            optimizer.master_params()
            if isinstance(optimizer, MasterWeightOptimizer)
            else [p for g in optimizer.param_groups for p in g["params"]]
        )
        model = optimizer.model_params() if isinstance(optimizer, MasterWeightOptimizer) else params
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.grads[trainer.global_step] = {names[id(m)]: p.grad.detach().float().clone() for m, p in zip(model, params)}


def fit(pl, tmp_path, monitor, plugin, max_steps=1, logger=True, extra=()):
    trainer = pl.Trainer(
        max_steps=max_steps,
        plugins=[plugin],
        callbacks=[monitor, *extra],
        logger=pl.loggers.CSVLogger(tmp_path, name="run") if logger else False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(as_lightning(pl, Planted)())
    return trainer


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def by_param(rows, step=0):
    return {r["param"]: r for r in rows if int(r["step"]) == step}


def test_tiny_gradients_underflow_at_scale_1_and_not_at_2_16(pl, tmp_path):
    monitor = GradientHealthMonitor(every_n_steps=1, verbose=False)
    fit(pl, tmp_path, monitor, MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**16)))
    with open(monitor.csv_path) as f:
        assert f.readline().strip() == (
            "step,param,numel,zero_frac,underflow_frac_scale1,underflow_frac_current,amax,headroom_bits"
        )
    rows = by_param(read_rows(monitor.csv_path))
    assert set(rows) == {"big.weight", "big.bias", "tiny.weight"}  # model names, not master copies
    tiny = rows["tiny.weight"]
    assert int(tiny["numel"]) == 8
    assert float(tiny["underflow_frac_scale1"]) == 1.0
    assert float(tiny["underflow_frac_current"]) == 0.0
    assert float(tiny["zero_frac"]) == 0.0
    assert float(tiny["amax"]) == pytest.approx(TINY, rel=1e-3)  # FP16 rounding of TINY * 2**16
    assert float(tiny["headroom_bits"]) == pytest.approx(math.log2(65504 / (TINY * 2**16)), abs=0.01)
    assert float(rows["big.weight"]["underflow_frac_scale1"]) < 0.5


def test_without_scaling_the_same_gradients_flush_to_zero(pl, tmp_path):
    monitor = GradientHealthMonitor(every_n_steps=1, verbose=False)
    fit(pl, tmp_path, monitor, MixedPrecisionPlugin("fp16", scaler=None))
    tiny = by_param(read_rows(monitor.csv_path))["tiny.weight"]
    # TINY / batch = 2.5e-8 is below half FP16's smallest subnormal: the output gradient is 0.
    assert float(tiny["zero_frac"]) == 1.0
    assert float(tiny["underflow_frac_scale1"]) == float(tiny["underflow_frac_current"]) == 1.0
    assert float(tiny["amax"]) == 0.0 and tiny["headroom_bits"] == "inf"


@pytest.mark.parametrize(
    "plugin",
    [
        pytest.param(lambda: MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**12)), id="master"),
        pytest.param(
            lambda: MixedPrecisionPlugin(
                "fp16", master_weights=False, autocast=True, scaler=DynamicLossScaler(init_scale=2.0**12)
            ),
            id="autocast",
        ),
        pytest.param(lambda: MixedPrecisionPlugin("fp32"), id="fp32"),
    ],
)
def test_every_column_matches_its_definition(pl, tmp_path, plugin):
    plugin = plugin()
    scale = plugin.scaler.get_scale()  # 1.0 without loss scaling
    monitor, capture = GradientHealthMonitor(every_n_steps=2, verbose=False), GradCapture()
    trainer = fit(pl, tmp_path, monitor, plugin, max_steps=3, extra=[capture])
    rows = read_rows(monitor.csv_path)
    assert sorted({int(r["step"]) for r in rows}) == [0, 2]
    for row in rows:
        g = capture.grads[int(row["step"])][row["param"]]
        a = g.abs()
        assert int(row["numel"]) == g.numel()
        assert float(row["zero_frac"]) == (a == 0).double().mean().item()
        assert float(row["underflow_frac_scale1"]) == (a < 2.0**-14).double().mean().item()
        assert float(row["underflow_frac_current"]) == (a * scale < 2.0**-14).double().mean().item()
        assert float(row["amax"]) == a.max().item()
        assert float(row["headroom_bits"]) == math.log2(65504 / (a.max().item() * scale))
    # The summaries, logged at the measured steps only.
    with open(f"{trainer.logger.log_dir}/metrics.csv", newline="") as f:
        logged = {int(r["step"]): r for r in csv.DictReader(f) if r.get("amp/underflow_frac_scale1")}
    assert sorted(logged) == [0, 2]
    last = by_param(rows, step=2).values()
    total = sum(int(r["numel"]) for r in last)
    expected = sum(float(r["underflow_frac_scale1"]) * int(r["numel"]) for r in last) / total
    assert float(logged[2]["amp/underflow_frac_scale1"]) == pytest.approx(expected)
    assert float(logged[2]["amp/min_headroom_bits"]) == pytest.approx(min(float(r["headroom_bits"]) for r in last))
    assert float(logged[2]["amp/worst_underflow_frac_current"]) == pytest.approx(
        max(float(r["underflow_frac_current"]) for r in last)
    )
    assert monitor.last_summary["amp/underflow_frac_scale1"] == pytest.approx(expected)


def test_rows_only_every_n_steps_and_no_work_in_between(pl, tmp_path, monkeypatch):
    measured = []
    original = grad_health.measure

    def counting(grads, scale):
        measured.append(len(grads))
        return original(grads, scale)

    monkeypatch.setattr(grad_health, "measure", counting)
    monitor = GradientHealthMonitor(every_n_steps=3, verbose=False)
    hook = monitor.on_before_optimizer_step
    torch_calls = {}

    class CountTorch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            torch_calls[step] = torch_calls.get(step, 0) + 1
            return func(*args, **(kwargs or {}))

    def wrapped(trainer, pl_module, optimizer):
        nonlocal step
        step = trainer.global_step
        torch_calls[step] = 0
        with CountTorch():
            hook(trainer, pl_module, optimizer)

    step = -1
    monitor.on_before_optimizer_step = wrapped
    fit(pl, tmp_path, monitor, MixedPrecisionPlugin("fp16"), max_steps=8)
    assert sorted({int(r["step"]) for r in read_rows(monitor.csv_path)}) == [0, 3, 6]
    assert measured == [3, 3, 3]
    assert {s: n for s, n in torch_calls.items() if s % 3} == {1: 0, 2: 0, 4: 0, 5: 0, 7: 0}
    assert all(torch_calls[s] > 0 for s in (0, 3, 6))


def test_one_host_sync_per_measurement(monkeypatch):
    calls = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or original(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() called"))
    grads = [torch.randn(5, 3), torch.zeros(4), torch.full((2,), 1e-10), torch.randn(7).half()]
    stats = grad_health.measure(grads, 2.0**16)
    assert calls == [1]
    assert stats[1] == [4.0, 4.0, 4.0, 0.0]
    assert stats[2] == [0.0, 2.0, 2.0, pytest.approx(1e-10)]


def test_headroom_formula():
    assert grad_health.headroom_bits(1.0, 2.0**16) == pytest.approx(math.log2(65504 / 65536))
    assert grad_health.headroom_bits(2.0**-20, 1.0) == pytest.approx(math.log2(65504) + 20)
    assert grad_health.headroom_bits(0.0, 8.0) == math.inf
    assert grad_health.headroom_bits(math.inf, 8.0) == -math.inf
    assert math.isnan(grad_health.headroom_bits(math.nan, 8.0))


def test_without_logger_the_csv_goes_to_default_root_dir(pl, tmp_path):
    monitor = GradientHealthMonitor(every_n_steps=1, verbose=False)
    fit(pl, tmp_path, monitor, MixedPrecisionPlugin("fp16"), logger=False)
    assert monitor.csv_path == str(tmp_path / "grad_health.csv")
    assert len(read_rows(monitor.csv_path)) == 3


def test_resume_keeps_rows_before_the_checkpoint_and_redoes_the_rest(pl, tmp_path):
    def trainer(max_steps, monitor):
        return pl.Trainer(
            max_steps=max_steps,
            plugins=[MixedPrecisionPlugin("fp16")],
            callbacks=[monitor],
            logger=False,
            default_root_dir=tmp_path,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    first = trainer(2, GradientHealthMonitor(every_n_steps=1, verbose=False))
    first.fit(as_lightning(pl, Planted)())
    first.save_checkpoint(tmp_path / "step2.ckpt")
    trainer(4, GradientHealthMonitor(every_n_steps=1, verbose=False)).fit(
        as_lightning(pl, Planted)(), ckpt_path=tmp_path / "step2.ckpt"
    )
    assert [int(r["step"]) for r in read_rows(tmp_path / "grad_health.csv")] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    before = read_rows(tmp_path / "grad_health.csv")[:6]
    trainer(3, GradientHealthMonitor(every_n_steps=1, verbose=False)).fit(
        as_lightning(pl, Planted)(), ckpt_path=tmp_path / "step2.ckpt"
    )
    rows = read_rows(tmp_path / "grad_health.csv")
    assert [int(r["step"]) for r in rows] == [0] * 3 + [1] * 3 + [2] * 3
    assert rows[:6] == before


def test_console_line_names_the_worst_layer(pl, tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(grad_health, "rank_zero_info", lines.append)
    fit(pl, tmp_path, GradientHealthMonitor(every_n_steps=1), MixedPrecisionPlugin("fp16", scaler=None))
    assert len(lines) == 1
    assert "grad health at step 0" in lines[0] and "worst tiny.weight (100.0%)" in lines[0]


def test_other_precision_plugins_measure_at_scale_1(pl, tmp_path):
    monitor = GradientHealthMonitor(every_n_steps=1, verbose=False)
    trainer = pl.Trainer(
        max_steps=1,
        callbacks=[monitor],
        logger=False,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="as if the loss scale were 1"):
        trainer.fit(as_lightning(pl, Planted)())
    tiny = by_param(read_rows(monitor.csv_path))["tiny.weight"]
    assert float(tiny["amax"]) == pytest.approx(TINY) and tiny["underflow_frac_current"] == "1.0"


def test_every_n_steps_is_checked():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="every_n_steps"):
            GradientHealthMonitor(every_n_steps=bad)
