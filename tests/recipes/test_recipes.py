"""Recipes train under plain FP32 Lightning, stay precision-agnostic, and the demos show their numerics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from amp_plugin.lightning import pl
from amp_plugin.recipes import (
    BertRecipe,
    CharGPTRecipe,
    DigitsRecipe,
    StagnationDemoRecipe,
    UnderflowDemoRecipe,
    ViTRecipe,
)
from amp_plugin.recipes.char_gpt import VOCAB_SIZE, build_corpus
from amp_plugin.recipes.digits import load_digits_split


@pytest.fixture(autouse=True)
def _one_thread():
    """Run these tiny models single-threaded: on a busy 2-core box OpenMP barriers cost more than the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# Small configurations of every recipe, with the metric keys each one must log.
RECIPES = {
    "digits_mlp": (DigitsRecipe, {}, {"train/loss", "val/loss", "val/acc"}),
    "digits_cnn": (DigitsRecipe, {"model": "cnn", "hidden_sizes": [8, 16]}, {"train/loss", "val/loss", "val/acc"}),
    "char_gpt": (CharGPTRecipe, {"max_chars": 50_000}, {"train/loss", "val/loss", "train/tokens_per_s"}),
    "underflow": (UnderflowDemoRecipe, {}, {"train/loss", "val/loss"}),
    "underflow_mlp": (UnderflowDemoRecipe, {"hidden_size": 8}, {"train/loss", "val/loss"}),
    "stagnation": (StagnationDemoRecipe, {}, {"train/loss", "val/loss", "train/weight_error"}),
    "vit": (ViTRecipe, {"n_train": 256, "n_val": 64}, {"train/loss", "val/loss", "val/acc"}),
    "vit_mean": (ViTRecipe, {"pool": "mean", "n_embd": 16, "n_train": 128}, {"train/loss", "val/loss", "val/acc"}),
    "bert": (BertRecipe, {"n_train": 256, "n_val": 64}, {"train/loss", "val/loss", "val/acc"}),
}


# ------------------------------------------------------------------------ every recipe


@pytest.mark.parametrize("name", list(RECIPES))
def test_fast_dev_run_fp32_logs_metrics(name):
    cls, kwargs, keys = RECIPES[name]
    pl.seed_everything(0, verbose=False)
    recipe = cls(**kwargs)
    trainer = _trainer(fast_dev_run=2)
    trainer.fit(recipe)
    metrics = trainer.callback_metrics
    assert keys <= set(metrics), f"missing {keys - set(metrics)}"
    for key in keys:
        assert math.isfinite(float(metrics[key])), (key, metrics[key])


@pytest.mark.parametrize("name", list(RECIPES))
def test_hydra_instantiates_with_plain_config(name):
    cls, kwargs, _ = RECIPES[name]
    cfg = OmegaConf.create({"_target_": f"{cls.__module__}.{cls.__name__}", **kwargs})
    recipe = instantiate(cfg)
    assert type(recipe) is cls
    for key, value in kwargs.items():
        assert recipe.hparams[key] == value


@pytest.mark.parametrize("name", ["digits_cnn", "char_gpt", "underflow", "stagnation", "vit", "bert"])
def test_checkpoint_restores_hparams_and_weights(name, tmp_path):
    cls, kwargs, _ = RECIPES[name]
    pl.seed_everything(0, verbose=False)
    recipe = cls(**kwargs)
    trainer = _trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(recipe)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    restored = cls.load_from_checkpoint(tmp_path / "last.ckpt")
    assert dict(restored.hparams) == dict(recipe.hparams)
    for a, b in zip(recipe.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_half_module_and_inputs_give_fp32_loss(name, dtype):
    """What a precision plugin does: cast params and float batch elements; ints stay ints."""
    cls, kwargs, _ = RECIPES[name]
    torch.manual_seed(0)
    recipe = cls(**kwargs)
    recipe.setup("fit")
    batch = next(iter(recipe.train_dataloader()))
    batch = [b[:4] for b in batch]  # half matmuls are slow on CPU; a few samples suffice
    recipe = recipe.to(dtype)
    batch = [b.to(dtype) if b.is_floating_point() else b for b in batch]
    loss = recipe.training_step(batch, 0)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    for p in recipe.parameters():
        assert p.dtype == dtype and p.grad is not None and p.grad.dtype == dtype
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize(
    "cls", [DigitsRecipe, CharGPTRecipe, UnderflowDemoRecipe, StagnationDemoRecipe, ViTRecipe, BertRecipe]
)
@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(lr=-1), ValueError, "lr=-1.0 is not allowed: lr must be a finite number > 0."),
        (dict(lr=math.nan), ValueError, "lr=nan is not allowed: lr must be a finite number > 0."),
        (dict(lr="abc"), TypeError, "lr='abc' is not allowed"),
        (dict(batch_size=0), ValueError, "batch_size=0 is not allowed: batch_size must be an integer >= 1."),
        (dict(batch_size=2.5), TypeError, "batch_size=2.5 is not allowed"),
    ],
)
def test_every_recipe_checks_its_arguments(cls, kwargs, error, text):
    """One message naming the argument, from the recipe's own constructor (the app prefixes ``recipe.``)."""
    with pytest.raises(error) as info:
        cls(**kwargs)
    assert text in str(info.value)


def test_invalid_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"hidden_sizes=\[0\] is not allowed: hidden_sizes must be a non-empty list"):
        DigitsRecipe(hidden_sizes=[0])
    with pytest.raises(ValueError, match="model='resnet'"):
        DigitsRecipe(model="resnet")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        DigitsRecipe(optimizer="lamb")
    with pytest.raises(ValueError, match="n_embd=60 must be divisible by n_head=8"):
        CharGPTRecipe(n_embd=60, n_head=8)
    with pytest.raises(ValueError, match="hidden_size=-1"):
        UnderflowDemoRecipe(hidden_size=-1)
    with pytest.raises(ValueError, match="weight_low=3"):
        StagnationDemoRecipe(weight_low=3.0, weight_high=2.0)


# ------------------------------------------------------------------------------ digits


def test_digits_split_is_scaled_stratified_and_seeded():
    x_train, y_train, x_val, y_val = load_digits_split(seed=0)
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == torch.float32
    assert y_train.dtype == torch.int64
    assert len(x_train) + len(x_val) == 1797
    assert float(x_train.min()) >= 0.0 and float(x_train.max()) <= 1.0
    assert set(y_val.tolist()) == set(range(10))
    again = load_digits_split(seed=0)
    other = load_digits_split(seed=1)
    assert torch.equal(again[0], x_train) and torch.equal(again[3], y_val)
    assert not torch.equal(other[0], x_train)


def test_digits_training_is_deterministic_under_seed_everything():
    def final_weights():
        pl.seed_everything(123, verbose=False)
        recipe = DigitsRecipe(hidden_sizes=[32])
        _trainer(max_steps=5, limit_val_batches=0).fit(recipe)
        return torch.cat([p.detach().flatten() for p in recipe.parameters()])

    assert torch.equal(final_weights(), final_weights())


def test_digits_reaches_90_percent_val_accuracy_in_fp32():
    pl.seed_everything(0, verbose=False)
    recipe = DigitsRecipe()
    trainer = _trainer(max_steps=120, limit_val_batches=0)
    trainer.fit(recipe)
    (metrics,) = _trainer().validate(recipe, verbose=False)
    assert metrics["val/acc"] >= 0.9, metrics


# ---------------------------------------------------------------------------- char_gpt


def test_char_corpus_builds_offline_and_deterministically():
    corpus = build_corpus()
    assert corpus.dtype == torch.int64 and corpus.ndim == 1
    assert 200_000 <= len(corpus) <= 1_000_000
    assert torch.equal(corpus, build_corpus())
    assert torch.equal(build_corpus(max_chars=1000), corpus[:1000])
    assert int(corpus.min()) >= 0 and int(corpus.max()) < VOCAB_SIZE == 256
    # Python source: mostly ASCII, well over a letters-only alphabet.
    assert 60 <= corpus.unique().numel() <= VOCAB_SIZE
    assert bytes(corpus[:2000].tolist()).decode("utf-8", errors="replace").count("def ") > 0


def test_char_batch_is_shifted_int64_windows():
    recipe = CharGPTRecipe(max_chars=20_000, block_size=32, batch_size=4)
    x, y = next(iter(recipe.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    val_x, val_y = next(iter(recipe.val_dataloader()))
    assert val_x.shape == (4, 32) and torch.equal(val_x[:, 1:], val_y[:, :-1])
    assert recipe(x).shape == (4, 32, VOCAB_SIZE)


def test_char_gpt_is_causal_and_ties_embeddings():
    torch.manual_seed(0)
    recipe = CharGPTRecipe(max_chars=1000, block_size=16).eval()
    assert recipe.model.head.weight is recipe.model.tok_emb.weight
    idx = torch.randint(0, VOCAB_SIZE, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB_SIZE
    with torch.no_grad():
        a, b = recipe(idx), recipe(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert CharGPTRecipe(max_chars=1000, tie_weights=False).model.head.weight is not None


# --------------------------------------------------------------------- underflow demo


def _grad_zero_fraction(model: torch.nn.Module, x, y, loss_weight: float, loss_scale: float) -> float:
    loss = loss_weight * F.mse_loss(model(x).float(), y.float())
    (loss * loss_scale).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return float((grads == 0).float().mean())


@pytest.mark.parametrize("hidden_size", [0, 8])
def test_underflow_fp16_gradients_vanish_without_loss_scaling(hidden_size):
    recipe = UnderflowDemoRecipe(hidden_size=hidden_size)
    x, y = next(iter(recipe.train_dataloader()))
    weight = recipe.hparams.loss_weight

    fp32 = copy.deepcopy(recipe.model)
    assert _grad_zero_fraction(fp32, x, y, weight, 1.0) == 0.0
    grads = torch.cat([p.grad.abs().flatten() for p in fp32.parameters()])
    assert 1e-9 < float(grads.median()) < 1e-6  # the 1e-8 .. 1e-7 band FP16 cannot hold

    unscaled = _grad_zero_fraction(copy.deepcopy(recipe.model).half(), x.half(), y.half(), weight, 1.0)
    scaled = _grad_zero_fraction(copy.deepcopy(recipe.model).half(), x.half(), y.half(), weight, 2.0**16)
    assert unscaled > 0.5
    assert scaled < 0.05
    assert recipe.gradient_zero_fraction() > 0.5
    assert recipe.gradient_zero_fraction(loss_scale=2.0**16) < 0.05
    assert recipe.gradient_zero_fraction(torch.bfloat16) == 0.0  # BF16 has FP32's range


@pytest.mark.parametrize("cls", [UnderflowDemoRecipe, StagnationDemoRecipe])
def test_demo_weights_never_move_under_lightning_pure_fp16(cls):
    """Lightning's own ``16-true`` (FP16 params, no scaler, no masters): both demos stay put."""
    recipe = cls()
    start = [p.detach().half().clone() for p in recipe.parameters()]
    _trainer(precision="16-true", max_steps=20, limit_val_batches=0).fit(recipe)
    for before, after in zip(start, recipe.parameters()):
        assert torch.equal(before, after.detach())


def test_underflow_demo_is_seeded_independently_of_global_rng():
    torch.manual_seed(1)
    a = UnderflowDemoRecipe()
    torch.manual_seed(2)
    b = UnderflowDemoRecipe()
    assert torch.equal(a.model.weight, b.model.weight)
    assert all(torch.equal(u, v) for u, v in zip(a._data, b._data))
    assert not torch.equal(UnderflowDemoRecipe(seed=1).model.weight, a.model.weight)


def test_underflow_fp32_sgd_learns_and_unscaled_fp16_grads_freeze():
    """Plain loop, FP32 master update: FP32 grads reach the noise floor, unscaled FP16 grads move nothing."""

    def train(dtype, loss_scale, steps=40):
        recipe = UnderflowDemoRecipe()
        model = copy.deepcopy(recipe.model).to(dtype)
        masters = [p.detach().float().clone() for p in model.parameters()]
        x, y = recipe._data[0], recipe._data[1]
        for step in range(steps):
            xb, yb = x[step % 16 * 64 :][:64], y[step % 16 * 64 :][:64]
            model.zero_grad()
            loss = recipe.hparams.loss_weight * F.mse_loss(model(xb.to(dtype)).float(), yb.float())
            (loss * loss_scale).backward()
            with torch.no_grad():
                for master, p in zip(masters, model.parameters()):
                    master -= recipe.hparams.lr * p.grad.float() / loss_scale
                    p.copy_(master)
        with torch.no_grad():
            return float(F.mse_loss(model(recipe._data[2].to(dtype)).float(), recipe._data[3]))

    start = train(torch.float32, 1.0, steps=0)
    assert train(torch.float32, 1.0) < 0.01 * start
    assert train(torch.float16, 2.0**16) < 0.01 * start
    assert train(torch.float16, 1.0) == pytest.approx(train(torch.float16, 1.0, steps=0))


# -------------------------------------------------------------------- stagnation demo


def test_stagnation_one_sgd_step_is_lost_in_fp16_but_not_fp32():
    recipe = StagnationDemoRecipe()
    x, y = next(iter(recipe.train_dataloader()))
    lr = recipe.hparams.lr

    def step(model, inputs):
        before = model.weight.detach().clone()
        F.mse_loss(model(inputs).float(), y.float()).backward()
        torch.optim.SGD(model.parameters(), lr=lr).step()
        return before, model.weight.detach()

    half = copy.deepcopy(recipe.model).half()
    before, after = step(half, x.half())
    assert (half.weight.grad != 0).all()  # healthy gradients: not an underflow problem
    assert torch.equal(before, after)  # every update rounded away, bit for bit

    full = copy.deepcopy(recipe.model)
    before, after = step(full, x)
    assert (before != after).all()

    assert recipe.lost_update_fraction(torch.float16) == 1.0
    assert recipe.lost_update_fraction(torch.bfloat16) == 1.0
    assert recipe.lost_update_fraction(torch.float32) == 0.0


def test_stagnation_pure_fp16_epoch_never_moves_while_fp32_learns():
    recipe = StagnationDemoRecipe()
    torch.manual_seed(0)
    half = copy.deepcopy(recipe.model).half()
    full = copy.deepcopy(recipe.model)
    w0 = half.weight.detach().clone()
    opts = [torch.optim.SGD(m.parameters(), lr=recipe.hparams.lr) for m in (half, full)]
    for x, y in recipe.train_dataloader():
        for model, opt, inputs in ((half, opts[0], x.half()), (full, opts[1], x)):
            opt.zero_grad()
            F.mse_loss(model(inputs).float(), y).backward()
            opt.step()
    assert torch.equal(half.weight, w0)
    start = float(recipe.weight_error())  # recipe.model itself was never trained
    assert float((full.weight.detach().flatten() - recipe.w_star).pow(2).mean().sqrt()) < 0.95 * start
