"""Lightning's own loop, callback and launcher scenarios, run against the plugin's presets with
Lightning's own precision as the control, over both Lightning namespaces.

Ported in spirit from Lightning's ``tests_pytorch`` (tag 2.6): ``callbacks/test_finetuning_callback.py``,
the scheduler cases of ``trainer/optimization/test_manual_optimization.py`` and ``models/test_amp.py``'s
``test_amp_cpus[ddp_spawn]``. Where the plugin differs from Lightning by design, the test says so
and pins the plugin's behaviour (docs/lightning_differences.md).
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from _models import PicklableClassifier, TwoSchedules, as_lightning, quiet_trainer, tiny_data
from torch import nn

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, MixedPrecisionPlugin

PRESETS = [
    *("fp32", "fp16", "bf16", "fp16_autocast", "bf16_autocast", "fp16_pure", "bf16_pure"),
    *("bf16_split", "bf16_lean", "bf16_sr"),
]
MASTER_PRESETS = ["fp16", "bf16", "bf16_split", "bf16_lean", "bf16_sr"]


def precision_kwargs(precision):
    """Trainer arguments: a plugin preset, or Lightning's own precision string (the control)."""
    if precision in PRESETS:
        return dict(plugins=[MixedPrecisionPlugin(precision)])
    return dict(precision=precision)


# ---------------------------------------------------------------------- finetuning callbacks
class Backboned:
    """A backbone and a head; the optimizer starts with what is trainable (Lightning's advice)."""

    def __init__(self, layers: int = 1):
        super().__init__()
        self.backbone = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tiny_data(16), batch_size=8)


def finetune(pl, precision, callbacks, max_epochs, tmp_path=None, ckpt_path=None, layers=1):
    pl.seed_everything(0)
    model = as_lightning(pl, Backboned)(layers=layers)
    saving = tmp_path is not None
    extra = [pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)] if saving else []
    trainer = quiet_trainer(
        pl,
        max_epochs=max_epochs,
        callbacks=[*callbacks, *extra],
        enable_checkpointing=saving,
        **precision_kwargs(precision),
    )
    backbone_before = model.backbone[0].weight.detach().float().clone()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model, backbone_before


@pytest.mark.parametrize("precision", [*MASTER_PRESETS, "32-true", "bf16-true"])
def test_backbone_finetuning_unfreezes_the_backbone_into_a_new_group(pl, precision):
    callback = pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
    trainer, model, backbone_before = finetune(pl, precision, [callback], max_epochs=3)
    opt = trainer.optimizers[0]
    assert len(opt.param_groups) == 2
    assert all(p.requires_grad for p in model.backbone.parameters())
    assert not torch.equal(model.backbone[0].weight.float(), backbone_before)  # trained after the unfreeze
    names = [g["params"] for g in callback._internal_optimizer_metadata[0]]
    assert names == [["head.weight", "head.bias"], ["backbone.0.weight", "backbone.0.bias"]]
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[1] == pytest.approx(callback.previous_backbone_lr)
    if precision in MASTER_PRESETS:
        # the new group's parameters have masters too (bf16_split: the model parameters hold them)
        assert len(opt.master_params()) == len(list(model.parameters()))
        assert isinstance(opt, MasterWeightOptimizer)
    assert type(callback) is pl.callbacks.BackboneFinetuning  # its own class again after the fit


class LayerByLayer:
    """Lightning's layer-by-layer BaseFinetuning: one more backbone layer unfrozen each epoch."""

    def __new__(cls, pl):
        class Callback(pl.callbacks.BaseFinetuning):
            def freeze_before_training(self, pl_module):
                self.freeze(pl_module.backbone)

            def finetune_function(self, pl_module, epoch, optimizer):
                if epoch < len(pl_module.backbone):
                    self.unfreeze_and_add_param_group(pl_module.backbone[epoch], optimizer)

        return Callback()


@pytest.mark.parametrize("precision", [*MASTER_PRESETS, "32-true"])
def test_base_finetuning_records_groups_by_name_and_restores_them_on_resume(pl, precision, tmp_path):
    callback = LayerByLayer(pl)
    trainer, model, _ = finetune(pl, precision, [callback], max_epochs=2, tmp_path=tmp_path, layers=3)
    names = [g["params"] for g in callback._internal_optimizer_metadata[0]]
    assert names == [[f"{m}.weight", f"{m}.bias"] for m in ("head", "backbone.0", "backbone.1")]
    resumed = LayerByLayer(pl)
    trainer, model, _ = finetune(pl, precision, [resumed], max_epochs=3, ckpt_path=tmp_path / "last.ckpt", layers=3)
    opt = trainer.optimizers[0]
    assert len(opt.param_groups) == 4  # three restored from the checkpoint, the last layer added at epoch 2
    assert len(resumed._internal_optimizer_metadata[0]) == 4
    if precision in MASTER_PRESETS:
        assert len(opt.master_params()) == len(list(model.parameters()))
    assert model.backbone[2].weight.requires_grad  # unfrozen by the resumed run


@pytest.mark.parametrize("precision", [*MASTER_PRESETS, "32-true"])
def test_unfreezing_parameters_the_optimizer_has_warns_and_adds_no_group(pl, precision):
    class UnfreezeAgain(pl.callbacks.BackboneFinetuning):
        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 0:  # the backbone is trainable and already in the optimizer
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, 0.1)

        def freeze_before_training(self, pl_module):
            pass

    with pytest.warns(UserWarning, match="Did you init your optimizer in"):
        trainer, _, _ = finetune(pl, precision, [UnfreezeAgain(unfreeze_backbone_at_epoch=3)], max_epochs=1)
    assert len(trainer.optimizers[0].param_groups) == 1


# ---------------------------------------------------------------------- manual optimization schedulers
def manual_schedule_steps(pl, precision, overflow_at=()):
    kwargs = precision_kwargs(precision)
    if precision == "fp16":
        kwargs = dict(plugins=[MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**8))])
    trainer = quiet_trainer(pl, max_epochs=1, **kwargs)
    trainer.fit(as_lightning(pl, TwoSchedules)(overflow_at=overflow_at))
    assert [c.interval for c in trainer.lr_scheduler_configs] == ["epoch", "epoch"]  # Lightning's manual configs
    return [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "fp32", "bf16", "bf16_lean", "bf16_sr"])
def test_manual_schedulers_step_as_with_lightnings_precision_when_nothing_skips(pl, precision):
    assert manual_schedule_steps(pl, precision) == manual_schedule_steps(pl, "32-true") == [4, 4]


def test_manual_schedulers_of_an_optimizer_that_skipped_are_held(pl):
    """Design difference: Lightning's ``16-mixed`` steps A's schedule on the skipped step too
    (its GradScaler skips the step, the user's ``sch.step()`` still runs); the plugin holds it."""
    assert manual_schedule_steps(pl, "fp16", overflow_at=(1,)) == [3, 4]


# ---------------------------------------------------------------------- pickling and ddp_spawn
@pytest.mark.parametrize("preset", PRESETS)
def test_the_plugin_pickles_for_every_preset(preset):
    plugin = MixedPrecisionPlugin(preset)
    copy = pickle.loads(pickle.dumps(plugin))
    assert repr(copy) == repr(plugin)  # the same preset and scaler settings
    assert copy.scaler.state_dict() == plugin.scaler.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16", "bf16_sr", "16-mixed"])
def test_ddp_spawn_trains_on_two_cpu_processes(pl, precision):
    """Lightning's ``test_amp_cpus[ddp_spawn-2]``: the plugin travels to each spawned process."""
    pl.seed_everything(0)
    model = as_lightning(pl, PicklableClassifier)(n=32)
    before = [p.detach().float().clone() for p in model.parameters()]
    trainer = quiet_trainer(pl, strategy="ddp_spawn", devices=2, max_steps=2, **precision_kwargs(precision))
    trainer.fit(model)
    assert trainer.state.finished
    after = [p.detach().float() for p in model.parameters()]  # the weights come back from rank 0
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


# ---------------------------------------------------------------------- logging
@pytest.mark.parametrize("precision", ["fp32", "32-true"])
def test_each_namespace_logs_under_its_own_logger(pl, precision):
    """``logging.getLogger("lightning.pytorch")`` (or ``"pytorch_lightning"``) reaches the messages
    of that package's Trainer, as Lightning's docs show, with both packages loaded."""
    name = pl.__name__
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    level = logger.level
    try:
        logger.setLevel(logging.INFO)
        quiet_trainer(pl, **precision_kwargs(precision))
        assert any(r.getMessage().startswith("GPU available") for r in records)
        assert {r.name.partition(".utilities")[0] for r in records} == {name}
        records.clear()
        logger.setLevel(logging.ERROR)
        quiet_trainer(pl, **precision_kwargs(precision))
        assert not records  # the level set on this package's logger silences it
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)


# ---------------------------------------------------------------------- module creation and refits
class BuiltInConfigureModel:
    """Lightning's pattern for large models: the layers are made in ``configure_model``."""

    def __init__(self):
        super().__init__()
        self.created_dtype = None

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = nn.Linear(8, 2)
            self.created_dtype = self.net.weight.dtype

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tiny_data(16), batch_size=8)


@pytest.mark.parametrize(
    "precision, created",
    [
        ("bf16_pure", torch.bfloat16),
        ("bf16-true", torch.bfloat16),  # the control
        ("fp16_pure", torch.float16),
        ("16-true", torch.float16),  # the control
        ("bf16", torch.float32),  # masters start from FP32 values; the module is cast after
        ("fp16_autocast", torch.float32),
    ],
)
def test_configure_model_creates_pure_half_modules_in_the_half_dtype(pl, precision, created):
    model = as_lightning(pl, BuiltInConfigureModel)()
    quiet_trainer(pl, max_steps=1, **precision_kwargs(precision)).fit(model)
    assert model.created_dtype == created  # no FP32 copy first (peak memory), as Lightning's *-true
    assert torch.get_default_dtype() == torch.float32


class OptimizerMadeOnce(Backboned):
    def __init__(self):
        super().__init__()
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_optimizers(self):
        return self.opt


@pytest.mark.parametrize("precision", ["fp16", "32-true"])
def test_a_second_fit_with_the_same_optimizer_object(pl, precision):
    """Design difference: master weights wrap the user's optimizer in place, so a second fit that
    returns the same object is refused with a message saying so; Lightning's precisions refit it."""
    model = as_lightning(pl, OptimizerMadeOnce)()
    quiet_trainer(pl, max_steps=1, **precision_kwargs(precision)).fit(model)
    second = quiet_trainer(pl, max_steps=2, **precision_kwargs(precision))
    if precision == "32-true":
        second.fit(model)
        assert second.global_step == 2
        return
    with pytest.raises(
        ValueError, match=r"same optimizer object cannot be given to a second fit.*inside configure_opt"
    ):
        second.fit(model)
