"""The encoder recipes (``ViTRecipe``, ``BertRecipe``): their generated data follow the stated rules,
the models attend both ways, AdamW runs at torch's default betas, and both learn in FP32."""

from __future__ import annotations

import math

import pytest
import torch

from amp_plugin.lightning import pl
from amp_plugin.recipes import BertRecipe, ViTRecipe
from amp_plugin.recipes.bert import make_majority
from amp_plugin.recipes.vit import SHAPES, make_shapes


@pytest.fixture(autouse=True)
def _one_thread():
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


# ----------------------------------------------------------------------------- shapes


def test_shapes_are_seeded_balanced_and_noise_free_at_noise_0():
    x, y = make_shapes(2000, seed=3)
    assert x.shape == (2000, 1, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    again, other = make_shapes(2000, seed=3), make_shapes(2000, seed=4)
    assert torch.equal(again[0], x) and torch.equal(again[1], y) and not torch.equal(other[0], x)
    counts = torch.bincount(y, minlength=len(SHAPES))
    assert len(SHAPES) == 10 and int(counts.min()) > 150  # about 200 of each
    clean, labels = make_shapes(500, noise=0.0, seed=3)
    lit = clean[:, 0] > 0
    values = clean[:, 0][lit]
    assert float(values.min()) >= 0.5 and float(values.max()) <= 1.5  # the brightness, nothing else
    assert bool((clean[:, 0][~lit] == 0).all())
    for image, label in zip(lit, labels.tolist()):
        rows, cols = image.any(dim=1).nonzero().flatten(), image.any(dim=0).nonzero().flatten()
        height, width = len(rows), len(cols)
        name = SHAPES[label]
        if name == "hline":
            assert height == 1 and width >= 5
        elif name == "vline":
            assert width == 1 and height >= 5
        elif name in ("diagonal", "antidiagonal"):
            assert int(image.sum()) == height == width >= 5
            r, c = image.nonzero().T
            assert bool(((c - r) == (c - r)[0]).all()) if name == "diagonal" else bool(((c + r) == (c + r)[0]).all())
        elif name == "box":
            assert int(image.sum()) == height * width and height == width
        elif name == "square":
            assert int(image.sum()) == 4 * (height - 1) and height == width
        elif name == "plus":
            assert int(image.sum()) == height + width - 1
        elif name == "cross":
            assert int(image.sum()) == 2 * height - 1 and height == width
    shown = {SHAPES[label] for label in labels.tolist()}
    assert shown == set(SHAPES)


def test_make_shapes_refuses_bad_arguments():
    with pytest.raises(ValueError, match="image_size=8 is not allowed: image_size must be an integer >= 10"):
        make_shapes(4, image_size=8)
    with pytest.raises(ValueError, match="noise=-1.0 is not allowed"):
        make_shapes(4, noise=-1.0)


# --------------------------------------------------------------------------- majority


def _majority(sequence: list[int], num_classes: int) -> int:
    counts = [sequence.count(k) for k in range(num_classes)]
    best = max(counts)
    tied = [k for k in range(num_classes) if counts[k] == best]
    return min(tied, key=sequence.index)


def test_majority_labels_follow_the_rule_and_ties_go_to_the_first():
    tokens, labels = make_majority(3000, seq_len=16, vocab_size=12, num_classes=3, seed=5)
    assert tokens.shape == (3000, 16) and tokens.dtype == labels.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 12
    ties = 0
    for sequence, label in zip(tokens.tolist(), labels.tolist()):
        counts = sorted((sequence.count(k) for k in range(3)), reverse=True)
        assert counts[0] >= 1  # at least one marker
        ties += counts[0] == counts[1]
        assert label == _majority(sequence, 3)
    assert 0.05 < ties / 3000 < 0.5
    assert torch.bincount(labels).min() > 800  # the three classes about equally often
    again = make_majority(3000, seq_len=16, vocab_size=12, num_classes=3, seed=5)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], labels)


def test_make_majority_refuses_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size=4 is not allowed: vocab_size must exceed num_classes=4"):
        make_majority(4, vocab_size=4, num_classes=4)
    with pytest.raises(ValueError, match="num_classes=1 is not allowed"):
        make_majority(4, num_classes=1)


# ----------------------------------------------------------------------------- models


def test_bert_attends_both_ways_and_vit_sees_every_patch():
    torch.manual_seed(0)
    bert = BertRecipe(n_train=8, n_val=8).eval()
    tokens = torch.randint(0, 32, (2, 32))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 32
    with torch.no_grad():
        assert not torch.allclose(bert(tokens), bert(changed))  # the CLS position sees the last token
        assert bert(tokens).shape == (2, 4)
    vit = ViTRecipe(n_train=8, n_val=8, pool="mean").eval()
    images = torch.randn(2, 1, 16, 16)
    brighter = images.clone()
    brighter[:, :, -4:, -4:] += 1.0  # the last patch only
    with torch.no_grad():
        assert vit(images).shape == (2, len(SHAPES))
        assert not torch.allclose(vit(images), vit(brighter))


@pytest.mark.parametrize("cls", [ViTRecipe, BertRecipe])
def test_adamw_at_torch_default_betas_with_warmup_then_cosine(cls):
    pl.seed_everything(0, verbose=False)
    recipe = cls(n_train=64, n_val=16, batch_size=8, n_embd=16, warmup_steps=10)
    trainer = _trainer(max_steps=30, limit_val_batches=0)
    trainer.fit(recipe)
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, torch.optim.AdamW)
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    for group in optimizer.param_groups:
        assert group["betas"] == defaults["betas"] == (0.9, 0.999) and group["eps"] == defaults["eps"] == 1e-8
    decayed = [g for g in optimizer.param_groups if g["weight_decay"] > 0]
    assert len(decayed) == 1 and all(p.ndim >= 2 for p in decayed[0]["params"])
    factor = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]
    assert factor(0) == pytest.approx(0.1) and factor(9) == 1.0 == factor(10)
    assert factor(20) == pytest.approx(0.55) and factor(30) == pytest.approx(0.1)
    constant = cls(n_train=64, n_val=16, batch_size=8, n_embd=16, warmup_steps=10, schedule="constant")
    trainer = _trainer(max_steps=30, limit_val_batches=0)
    trainer.fit(constant)
    assert trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0](25) == 1.0


@pytest.mark.parametrize(
    "cls, kwargs, text",
    [
        (ViTRecipe, {"image_size": 18}, "image_size=18 is not allowed: image_size must be a multiple of patch_size=4"),
        (ViTRecipe, {"n_embd": 30}, "n_embd=30 is not allowed: n_embd must be divisible by n_head=4"),
        (ViTRecipe, {"pool": "max"}, "pool='max' is not allowed: pool must be one of 'cls', 'mean'"),
        (ViTRecipe, {"noise": -0.1}, "noise=-0.1 is not allowed"),
        (BertRecipe, {"schedule": "linear"}, "schedule='linear' is not allowed: schedule must be one of 'cosine'"),
        (BertRecipe, {"num_classes": 40}, "vocab_size=32 is not allowed: vocab_size must exceed num_classes=40"),
        (BertRecipe, {"dropout": 1.0}, "dropout=1.0 is not allowed: dropout must be a finite number >= 0 and < 1"),
        (BertRecipe, {"n_train": 0}, "n_train=0 is not allowed: n_train must be an integer >= 1"),
    ],
)
def test_encoder_recipes_name_the_bad_argument(cls, kwargs, text):
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert text in str(info.value)


# --------------------------------------------------------------------------- learning


@pytest.mark.slow
@pytest.mark.parametrize(
    "cls, kwargs, steps, accuracy",
    [
        (BertRecipe, {"seq_len": 16, "n_embd": 32, "n_layer": 1, "lr": 3e-3}, 200, 0.8),
        (ViTRecipe, {"n_embd": 32, "n_layer": 1, "noise": 0.3, "lr": 3e-3}, 200, 0.3),
    ],
)
def test_both_learn_in_fp32(cls, kwargs, steps, accuracy):
    pl.seed_everything(0, verbose=False)
    recipe = cls(n_train=4096, n_val=512, **kwargs)
    (before,) = _trainer().validate(recipe, verbose=False)
    _trainer(max_steps=steps, limit_val_batches=0).fit(recipe)
    (after,) = _trainer().validate(recipe, verbose=False)
    chance = 1 / recipe.model.head.out_features
    assert before["val/acc"] < 2 * chance and after["val/acc"] >= accuracy, (before, after)
    assert after["val/loss"] < before["val/loss"] - 0.3 and math.isfinite(after["val/loss"])
