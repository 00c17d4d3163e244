"""Checkpoints carry the scaler and the FP32 masters; resuming continues bit for bit."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _models import TinyClassifier, as_lightning, quiet_trainer

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, MixedPrecisionPlugin
from amp_plugin.lightning.plugin import CHECKPOINT_KEY


def make(pl, precision="fp16", **plugin_kwargs):
    pl.seed_everything(0)
    # Overflows only where a scaler can skip them (bf16 has none by default).
    overflow_at = (1, 5, 6) if precision == "fp16" else ()
    model = as_lightning(pl, TinyClassifier)(overflow_at=overflow_at, n=24, scheduler_gamma=0.9, step_keyed=True)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, hysteresis=2) if precision == "fp16" else None
    return model, MixedPrecisionPlugin(precision, scaler=scaler, **plugin_kwargs)


def final_state(trainer, model, plugin):
    opt = trainer.optimizers[0]
    masters = opt.fp32_masters() if isinstance(opt, MasterWeightOptimizer) else list(model.parameters())
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in masters],
        "opt": opt.state_dict(),
        "scaler": plugin.scaler.state_dict(),
        "lr": opt.param_groups[0]["lr"],
    }


def assert_same(a, b):
    for key in ("params", "masters"):
        for x, y in zip(a[key], b[key]):
            assert x.dtype == y.dtype and torch.equal(x, y), key
    assert a["scaler"] == b["scaler"]
    assert a["lr"] == b["lr"]
    for sa, sb in zip(a["opt"]["state"].values(), b["opt"]["state"].values()):
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, kwargs",
    [
        ("fp16", {}),
        ("bf16", {}),
        ("bf16_split", {}),
        ("bf16_lean", {}),
        ("bf16_sr", {}),
        ("fp16", dict(master_weights=False, autocast=True)),
    ],
)
def test_resume_is_bit_exact(pl, tmp_path, precision, kwargs):
    """A run that saves a checkpoint each epoch; resuming from the first gives the same end state.

    Batches are keyed by global_step: Lightning restarts a plain DataLoader from its first
    batch on resume, which would change the data, not our state.
    """
    model, plugin = make(pl, precision, **kwargs)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=8, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(model)
    uninterrupted = final_state(trainer, model, plugin)

    model, plugin = make(pl, precision, **kwargs)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=8)
    trainer.fit(model, ckpt_path=tmp_path / "epoch=0.ckpt")  # saved after step 3 of 8
    assert_same(final_state(trainer, model, plugin), uninterrupted)
    if precision == "fp16":
        assert plugin.scaler.skipped_steps == 3


def test_checkpoint_layout(pl, tmp_path):
    model, plugin = make(pl)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    saved = ckpt[CHECKPOINT_KEY]
    assert saved["precision"] == "fp16" and saved["scaler_type"] == "DynamicLossScaler"
    assert saved["scaler"]["scale"] == plugin.scaler.get_scale()
    assert saved["scaler"]["skipped_steps"] == 1
    assert "MixedPrecisionPlugin" not in ckpt  # not keyed by class name
    masters = ckpt["optimizer_states"][0]["master_params"]
    # Two Linear layers (weight, bias); the FP32 LayerNorm is its own master.
    assert [m.dtype for m in masters] == [torch.float32] * 4


def test_resuming_with_another_precision_warns_and_keeps_the_new_scaler(pl, tmp_path):
    model, plugin = make(pl, "fp16")
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    model, plugin = make(pl, "bf16")
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=4)
    with pytest.warns(UserWarning, match=r"precision: checkpoint 'fp16', now 'bf16'.*not restored"):
        trainer.fit(model, ckpt_path=tmp_path / "c.ckpt")


@pytest.mark.parametrize(
    "saved, now, named",
    [
        ("bf16_lean", "bf16_split", "moments: checkpoint 'bf16', now 'fp32'"),  # exact, but not the same setup
        ("bf16", "fp8", "fp8_gemms: checkpoint False, now True"),  # the FP8 scales start afresh
        ("fp8", "bf16", "fp8_gemms: checkpoint True, now False"),  # the FP8 amax histories are dropped
    ],
)
def test_resuming_across_moments_or_fp8_warns_as_other_setups_do(pl, tmp_path, saved, now, named):
    """A resume with another moments dtype or with FP8 on one side only changes the setup as another
    precision does, and warns alike; the checkpoint's record said neither, and these went silently."""
    model, plugin = make(pl, saved)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=2)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    model, plugin = make(pl, now)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    with pytest.warns(UserWarning, match="Resuming with a different mixed-precision setup .*" + re.escape(named)):
        trainer.fit(model, ckpt_path=tmp_path / "c.ckpt")


@pytest.mark.parametrize("preset", ["bf16_lean", "fp8"])
def test_a_checkpoint_written_before_the_moments_and_fp8_record_resumes_without_a_warning(pl, tmp_path, preset):
    """A checkpoint of the same setup written before the record held ``moments`` and ``fp8_gemms``: no
    warning (FP8 is told by its layers' state, which such a checkpoint holds)."""
    model, plugin = make(pl, preset)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=2)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=False)
    for key in ("moments", "fp8_gemms"):  # what a checkpoint written before these keys holds
        del checkpoint[CHECKPOINT_KEY][key]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    model, plugin = make(pl, preset)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Resuming with a different mixed-precision setup")
        trainer.fit(model, ckpt_path=tmp_path / "old.ckpt")


def test_changed_scaler_settings_warn_and_win(pl, tmp_path):
    model, plugin = make(pl, "fp16")
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    trainer.fit(model)
    scale = plugin.scaler.get_scale()
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    model = as_lightning(pl, TinyClassifier)(n=32)
    plugin = MixedPrecisionPlugin(
        "fp16", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=50, hysteresis=2)
    )
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    with pytest.warns(UserWarning, match=r"growth_interval: 2 -> 50"):
        trainer.fit(model, ckpt_path=tmp_path / "c.ckpt")
    assert plugin.scaler.growth_interval == 50
    assert plugin.scaler.get_scale() == scale


def test_resuming_with_another_hysteresis_uses_it_from_the_first_overflow(pl, tmp_path):
    """Saved mid-hysteresis (one of two overflows absorbed), resumed with hysteresis=3: the next
    two overflows are absorbed too, the third backs off."""
    model = as_lightning(pl, TinyClassifier)(overflow_at=(1,), n=32)
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, hysteresis=2))
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    trainer.fit(model)
    assert plugin.scaler.state_dict()["_hysteresis_tracker"] == 1
    trainer.save_checkpoint(tmp_path / "c.ckpt")

    model = as_lightning(pl, TinyClassifier)(overflow_at=(3, 4, 5), n=32)
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**10, hysteresis=3))
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=6)
    with pytest.warns(UserWarning, match=r"hysteresis: 2 -> 3"):
        trainer.fit(model, ckpt_path=tmp_path / "c.ckpt")
    assert plugin.scaler.skipped_steps == 4  # one before the checkpoint, three after
    assert plugin.scaler.get_scale() == 2.0**9  # two overflows absorbed, the third backed off


class EveryOtherStepKeyed(TinyClassifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}}


def test_resume_mid_epoch_keeps_counting_a_frequency_in_steps_taken(pl, tmp_path):
    """Saved after step 3 of 8, one step skipped before it (on a frequency-2 boundary): the resumed
    schedule is where the uninterrupted one is (3 schedule steps for 7 steps taken, not 4)."""

    def run(max_steps, ckpt_path=None, callbacks=()):
        model = as_lightning(pl, EveryOtherStepKeyed)(overflow_at=(1,), lr=0.1, n=256, step_keyed=True)
        plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**8))
        trainer = quiet_trainer(
            pl, plugins=[plugin], max_steps=max_steps, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)
        )
        trainer.fit(model, ckpt_path=ckpt_path)
        return trainer

    uninterrupted = run(8).lr_scheduler_configs[0].scheduler.last_epoch
    assert uninterrupted == 3
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=3)
    run(3, callbacks=[saver])
    resumed = run(8, ckpt_path=tmp_path / "step=3.ckpt")
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == uninterrupted


def test_the_fp32_preset_writes_the_checkpoint_lightnings_32_true_writes(pl, tmp_path):
    """Nothing to restore, so no amp_plugin section: the checkpoints compare key by key."""
    saved = {}
    for name, trainer_kwargs in (("ours", dict(plugins=[MixedPrecisionPlugin("fp32")])), ("32-true", {})):
        pl.seed_everything(0)
        model = as_lightning(pl, TinyClassifier)(n=24, scheduler_gamma=0.9)
        trainer = quiet_trainer(pl, max_steps=3, **trainer_kwargs)
        trainer.fit(model)
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        saved[name] = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
    assert CHECKPOINT_KEY not in saved["ours"]
    assert saved["ours"].keys() == saved["32-true"].keys()
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        assert str(saved["ours"][key]) == str(saved["32-true"][key]), key
    model, plugin = make(pl, "fp32")
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=4)
    trainer.fit(model, ckpt_path=tmp_path / "ours.ckpt")  # resumes without a section
    assert trainer.global_step == 4
