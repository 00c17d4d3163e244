"""LossScaleMonitor: scale events in scale_events.csv, metrics per optimizer step, no host sync."""

from __future__ import annotations

import csv
import logging
import warnings

import pytest
import torch
from _models import as_lightning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin import DynamicLossScaler, LossScaleCollapseError, StaticLossScaler
from amp_plugin.callbacks import LossScaleMonitor, ScaleEvent
from amp_plugin.lightning.namespace import Callback
from amp_plugin.lightning.plugin import MixedPrecisionPlugin

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]


class Net:
    """A tiny regression; ``inf_at`` / ``nan_at`` plant non-finite gradients at global steps."""

    def __init__(self, inf_at=(), nan_bias_at=(), n=64):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 1)
        self.inf_at, self.nan_bias_at, self.n = set(inf_at), set(nan_bias_at), n

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.l2(torch.tanh(self.l1(x))).float() - y.float()) ** 2).mean()

    def on_after_backward(self):
        if self.global_step in self.inf_at:
            self.l2.weight.grad[0, :3] = float("inf")
        if self.global_step in self.nan_bias_at:
            self.l1.bias.grad[0] = float("nan")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(
            TensorDataset(torch.randn(self.n, 4, generator=g), torch.randn(self.n, 1, generator=g)), batch_size=4
        )


def small_scaler(**kwargs):
    return DynamicLossScaler(init_scale=2.0**10, growth_interval=3, **kwargs)


def fit(pl, tmp_path, model, monitor, max_steps, scaler=None, logger=True, plugin=None, **kwargs):
    plugin = plugin or MixedPrecisionPlugin("fp16", scaler=scaler if scaler is not None else small_scaler())
    trainer = pl.Trainer(
        max_steps=max_steps,
        plugins=[plugin],
        callbacks=[monitor],
        logger=pl.loggers.CSVLogger(tmp_path, name="run") if logger else False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def step_metrics(trainer, *names):
    """``{step: {name: value}}`` from CSVLogger's metrics.csv (rows with any of ``names``)."""
    out = {}
    with open(f"{trainer.logger.log_dir}/metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            values = {n: float(row[n]) for n in names if row.get(n)}
            if values:
                out.setdefault(int(row["step"]), {}).update(values)
    return out


# Overflows at steps 2, 3 and 9 with growth_interval=3 and hysteresis 1:
# 1024 -> 512 (2) -> 256 (3), clean 4, 5, 6 -> grows to 512 at 6, overflow at 9 -> 256.
EXPECTED_EVENTS = [
    (2, 1024.0, 512.0, "overflow", "l2.weight:3"),
    (3, 512.0, 256.0, "overflow", "l2.weight:3;l1.bias:1"),
    (6, 256.0, 512.0, "growth", ""),
    (9, 512.0, 256.0, "overflow", "l2.weight:3"),
]
SCALE_PER_STEP = [1024, 1024, 1024, 512, 256, 256, 256, 512, 512, 512, 256, 256]
SKIPPED_PER_STEP = [0, 0, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3]


def test_scale_events_csv_rows_and_metrics_per_step(pl, tmp_path):
    monitor = LossScaleMonitor()
    trainer = fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={2, 3, 9}, nan_bias_at={3}), monitor, max_steps=12)

    rows = read_csv(f"{trainer.log_dir}/scale_events.csv")
    assert rows[0] == ["step", "old_scale", "new_scale", "reason", "nonfinite_params"]
    parsed = [(int(s), float(o), float(n), r, p) for s, o, n, r, p in rows[1:]]
    assert parsed == EXPECTED_EVENTS
    assert [(e.step, e.old_scale, e.new_scale, e.reason) for e in monitor.events] == [e[:4] for e in EXPECTED_EVENTS]
    assert monitor.events[1].nonfinite_params == (("l2.weight", 3), ("l1.bias", 1))

    metrics = step_metrics(trainer, "amp/loss_scale", "amp/skipped_steps")
    assert sorted(metrics) == list(range(12))
    assert [metrics[s]["amp/loss_scale"] for s in range(12)] == SCALE_PER_STEP
    assert [metrics[s]["amp/skipped_steps"] for s in range(12)] == SKIPPED_PER_STEP
    assert trainer.progress_bar_metrics["amp/loss_scale"] == 256.0
    assert trainer.progress_bar_metrics["amp/skipped_steps"] == 3.0


def test_gradient_accumulation_logs_once_per_optimizer_step(pl, tmp_path):
    monitor = LossScaleMonitor()
    trainer = fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={1}), monitor, max_steps=4, accumulate_grad_batches=2)
    assert [(e.step, e.old_scale, e.new_scale, e.reason) for e in monitor.events] == [(1, 1024.0, 512.0, "overflow")]
    metrics = step_metrics(trainer, "amp/loss_scale", "amp/skipped_steps")
    assert {s: (m["amp/loss_scale"], m["amp/skipped_steps"]) for s, m in metrics.items()} == {
        0: (1024, 0),
        1: (1024, 1),
        2: (512, 1),
        3: (512, 1),
    }


def test_without_logger_the_csv_goes_to_default_root_dir(pl, tmp_path):
    monitor = LossScaleMonitor()
    fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={1}), monitor, max_steps=3, logger=False)
    assert monitor.csv_path == str(tmp_path / "scale_events.csv")
    assert read_csv(monitor.csv_path)[1][:4] == ["1", "1024.0", "512.0", "overflow"]


def test_static_scaler_skips_are_recorded(pl, tmp_path):
    monitor = LossScaleMonitor()
    fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={1}), monitor, max_steps=3, scaler=StaticLossScaler(128.0))
    assert monitor.events == [ScaleEvent(1, 128.0, 128.0, "skipped", (("l2.weight", 3),))]


def test_hysteresis_skips_are_events_that_keep_the_scale(pl, tmp_path):
    monitor = LossScaleMonitor()
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=100, hysteresis=2)
    fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={1, 2}), monitor, max_steps=4, scaler=scaler)
    assert [e.row() for e in monitor.events] == [
        (1, 1024.0, 1024.0, "hysteresis", "l2.weight:3"),
        (2, 1024.0, 512.0, "overflow", "l2.weight:3"),
    ]


def test_collapse_at_min_scale_is_recorded_before_the_run_dies(pl, tmp_path):
    monitor = LossScaleMonitor()
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0)
    with pytest.raises(LossScaleCollapseError):
        fit(pl, tmp_path, as_lightning(pl, Net)(inf_at=range(10)), monitor, max_steps=5, scaler=scaler)
    rows = read_csv(monitor.csv_path)[1:]
    assert [r[:4] for r in rows] == [["0", "2.0", "1.0", "overflow"], ["1", "1.0", "1.0", "min_scale"]]


@pytest.fixture
def notices(pl):
    """Console notices (rank_zero_info lines) emitted by amp_plugin's callbacks, on the rank-zero
    logger of the namespace whose Trainer runs."""
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("amp:"):
                lines.append(record.getMessage())

    logger = logging.getLogger(f"{pl.__name__}.utilities.rank_zero")
    handler = Collect(level=logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_every_event_noticed_with_overflowing_param_names(pl, tmp_path, notices):
    fit(
        pl,
        tmp_path,
        as_lightning(pl, Net)(inf_at={2, 3, 9}, nan_bias_at={3}),
        LossScaleMonitor(notice_interval_s=0),
        max_steps=12,
    )
    assert len(notices) == 4
    assert "step 3" in notices[1] and "l2.weight:3;l1.bias:1" in notices[1] and "512 -> 256" in notices[1]
    assert "256 -> 512" in notices[2] and "growth" in notices[2]


def test_notices_are_rate_limited_and_counted(pl, tmp_path, notices):
    fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={2, 3, 9}), LossScaleMonitor(notice_interval_s=3600), max_steps=12)
    assert len(notices) == 2  # the first event, then the end-of-training count
    assert "step 2" in notices[0] and "l2.weight:3" in notices[0]
    assert "3 loss-scale event(s) not shown" in notices[1] and "scale_events.csv" in notices[1]


def test_no_notices_when_disabled(pl, tmp_path, notices):
    fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={2}), LossScaleMonitor(notice_interval_s=None), max_steps=4)
    assert notices == []


SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def test_adds_no_host_sync(pl, tmp_path, monkeypatch):
    """The hooks never read a tensor back, and what they log is a CPU tensor."""
    monitor = LossScaleMonitor()
    calls, inside, logged = [], [False], []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            if inside[0]:
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for hook in ("on_train_start", "on_train_batch_start", "on_train_batch_end"):
        original_hook = getattr(monitor, hook)

        def wrapped(*args, _hook=original_hook, **kwargs):
            inside[0] = True
            try:
                return _hook(*args, **kwargs)
            finally:
                inside[0] = False

        setattr(monitor, hook, wrapped)
    original_log = pl.LightningModule.log

    def spy_log(self, name, value, *args, **kwargs):
        logged.append((name, value.device))
        return original_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", spy_log)
    fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={2}), monitor, max_steps=5)
    assert calls == []
    assert len(logged) == 15 and {device.type for _, device in logged} == {"cpu"}  # 3 metrics, 5 steps


class _Window(Callback):
    """Counts ``Tensor.item`` calls between the first batch-start hook and the last batch-end hook."""

    def __init__(self, counter, opens):
        self.counter, self.opens = counter, opens

    def on_train_batch_start(self, *args):
        if self.opens:
            self.counter["open"] = True

    def on_train_batch_end(self, *args):
        if not self.opens:
            self.counter["open"] = False


def item_calls_per_run(pl, tmp_path, monkeypatch, monitors, device="cpu"):
    counts = []
    counter = {"open": False}
    original = torch.Tensor.item

    def counting(self):
        if counter["open"]:
            counts[-1] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", counting)
    for monitor in monitors:
        counts.append(0)
        callbacks = [_Window(counter, opens=True)] + ([monitor] if monitor else []) + [_Window(counter, opens=False)]
        trainer = pl.Trainer(
            max_steps=6,
            plugins=[MixedPrecisionPlugin("fp16", scaler=small_scaler())],
            callbacks=callbacks,
            logger=pl.loggers.CSVLogger(tmp_path),
            log_every_n_steps=1,
            accelerator=device,
            devices=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(as_lightning(pl, Net)(inf_at={2}))
    return counts


def test_same_item_calls_per_step_with_and_without_the_monitor(pl, tmp_path, monkeypatch):
    """From batch start to batch end, with a skipped step among them: the monitor adds no .item()."""
    without, with_monitor = item_calls_per_run(pl, tmp_path, monkeypatch, [None, LossScaleMonitor(notice_interval_s=0)])
    assert without == with_monitor > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_device_syncs_with_and_without_the_monitor_on_cuda(pl, tmp_path):
    """CUDA's sync debug mode flags every host-device synchronisation of a whole run."""
    counts = []
    for callbacks in ([], [LossScaleMonitor(notice_interval_s=0)]):
        trainer = pl.Trainer(
            max_steps=6,
            plugins=[MixedPrecisionPlugin("fp16", scaler=small_scaler())],
            callbacks=callbacks,
            logger=pl.loggers.CSVLogger(tmp_path),
            log_every_n_steps=1,
            accelerator="cuda",
            devices=1,
            enable_checkpointing=False,
            enable_progress_bar=True,
            enable_model_summary=False,
        )
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(as_lightning(pl, Net)(inf_at={2}))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert counts[0] == counts[1]


def test_resume_rewrites_the_history_then_appends(pl, tmp_path):
    straight = LossScaleMonitor()
    fit(pl, tmp_path / "a", as_lightning(pl, Net)(inf_at={2, 3, 9}), straight, max_steps=12)

    first = LossScaleMonitor()
    trainer = fit(pl, tmp_path / "b", as_lightning(pl, Net)(inf_at={2, 3, 9}), first, max_steps=5)
    ckpt = tmp_path / "b" / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = LossScaleMonitor()
    plugin = MixedPrecisionPlugin("fp16", scaler=small_scaler())
    trainer = pl.Trainer(
        max_steps=12,
        plugins=[plugin],
        callbacks=[resumed],
        logger=pl.loggers.CSVLogger(tmp_path / "b", name="run"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(as_lightning(pl, Net)(inf_at={2, 3, 9}), ckpt_path=ckpt)
    assert resumed.events == straight.events
    assert read_csv(resumed.csv_path) == read_csv(straight.csv_path)
    assert resumed.csv_path != first.csv_path  # a new version dir, with the whole history


def test_other_precision_plugins_warn_once_and_log_nothing(pl, tmp_path):
    monitor = LossScaleMonitor()
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[monitor],
        logger=pl.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="LossScaleMonitor reads the state of amp_plugin's MixedPrecisionPlugin"):
        trainer.fit(as_lightning(pl, Net)())
    assert monitor.events == [] and "amp/loss_scale" not in trainer.logged_metrics


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="notice_interval_s"):
        LossScaleMonitor(notice_interval_s=-1)
    with pytest.raises(TypeError, match="prog_bar"):
        LossScaleMonitor(prog_bar="yes")


class OnceNet(Net):
    """``Net`` whose inf gradients come on the first attempt of each listed step only."""

    def on_after_backward(self):
        if self.global_step in self.inf_at:
            self.inf_at = self.inf_at - {self.global_step}
            self.l2.weight.grad[0, :3] = float("inf")


def test_retries_are_events_and_counted_beside_the_skips(pl, tmp_path):
    monitor = LossScaleMonitor()
    model = as_lightning(pl, OnceNet)(inf_at={2})
    trainer = fit(pl, tmp_path, model, monitor, max_steps=4, scaler=small_scaler(retries=1))
    rows = read_csv(f"{trainer.log_dir}/scale_events.csv")[1:]
    assert rows == [["2", "1024.0", "512.0", "retry", ""]]
    names = ("amp/loss_scale", "amp/skipped_steps", "amp/retried_steps", "amp/wasted_compute")
    metrics = step_metrics(trainer, *names)
    assert [tuple(metrics[s][n] for n in names) for s in range(4)] == [
        (1024, 0, 0, 0.0),
        (1024, 0, 0, 0.0),
        (512, 0, 1, 0.25),  # the batch ran again at 512 and was trained on: 1 of 4 passes wasted
        (512, 0, 1, float(torch.tensor(1 / 5))),  # logged as a float32 tensor
    ]


def test_a_retry_that_overflows_again_is_a_retry_then_a_skip(pl, tmp_path):
    monitor = LossScaleMonitor()
    trainer = fit(pl, tmp_path, as_lightning(pl, Net)(inf_at={1}), monitor, max_steps=2, scaler=small_scaler(retries=1))
    assert [(e.step, e.old_scale, e.new_scale, e.reason, e.nonfinite_params) for e in monitor.events] == [
        (1, 1024.0, 512.0, "retry", ()),
        (1, 512.0, 256.0, "overflow", (("l2.weight", 3),)),
    ]
    assert trainer.precision_plugin.scaler.wasted_fraction == 2 / 3
