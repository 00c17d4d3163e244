"""What ``bench_end_to_end.py`` trains: its two recipes (full size and ``--quick``) and its twelve
configurations, ours in every preset of ``configs/precision/`` and Lightning's own precisions.

A :class:`Config` builds fresh Trainer arguments (plugin objects) for every fit, says whether it runs
PyTorch's native CPU half kernels (slow: fewer steps) and names its Lightning counterpart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from _harness import lightning_16_mixed_cpu

from amp_plugin import MixedPrecisionPlugin
from amp_plugin.lightning import pl
from amp_plugin.recipes import CharGPTRecipe, DigitsRecipe

__all__ = ["BY_NAME", "CONFIGS", "FP32_REFERENCE", "QUICK_RECIPES", "RECIPES", "Config"]

RECIPES: dict[str, Callable[..., pl.LightningModule]] = {
    "char_gpt": partial(
        CharGPTRecipe,
        n_layer=2,
        n_head=4,
        n_embd=128,
        block_size=64,
        batch_size=16,
        max_chars=200_000,
        warmup_steps=0,
        adam_eps=1e-4,
    ),
    "digits": partial(DigitsRecipe, adam_eps=1e-4),
}
QUICK_RECIPES: dict[str, Callable[..., pl.LightningModule]] = {
    "char_gpt": partial(
        CharGPTRecipe,
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=16,
        batch_size=4,
        max_chars=20_000,
        warmup_steps=0,
        adam_eps=1e-4,
    ),
    "digits": partial(DigitsRecipe, hidden_sizes=(16,), batch_size=16, adam_eps=1e-4),
}


@dataclass(frozen=True)
class Config:
    name: str
    trainer_kwargs: Callable[[], dict[str, Any]]  # fresh plugin objects for every fit
    native: bool = False  # runs PyTorch's native CPU half kernels (slow): fewer steps
    counterpart: str | None = None  # the Lightning configuration in the matching mode


def _ours(**kwargs: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"plugins": [MixedPrecisionPlugin(**kwargs)]}


def _lightning(precision: str) -> Callable[[], dict[str, Any]]:
    return lambda: {"precision": precision}


FP32_REFERENCE = "Lightning 32-true"
CONFIGS: tuple[Config, ...] = (
    Config("ours fp32", _ours(precision="fp32"), counterpart="Lightning 32-true"),
    Config("ours fp16", _ours(precision="fp16")),
    Config("ours bf16", _ours(precision="bf16")),
    Config(
        "ours fp16_autocast",
        _ours(precision="fp16", master_weights=False, autocast=True),
        counterpart="Lightning 16-mixed (CPU GradScaler)",
    ),
    Config(
        "ours bf16_autocast",
        _ours(precision="bf16", master_weights=False, autocast=True),
        counterpart="Lightning bf16-mixed",
    ),
    Config("ours fp16_pure", _ours(precision="fp16", master_weights=False), counterpart="Lightning 16-true"),
    Config("ours bf16_pure", _ours(precision="bf16", master_weights=False), counterpart="Lightning bf16-true"),
    Config("Lightning 32-true", _lightning("32-true")),
    Config("Lightning bf16-mixed", _lightning("bf16-mixed"), native=True),
    Config("Lightning 16-mixed (CPU GradScaler)", lightning_16_mixed_cpu, native=True),
    Config("Lightning 16-true", _lightning("16-true"), native=True),
    Config("Lightning bf16-true", _lightning("bf16-true"), native=True),
)
BY_NAME = {c.name: c for c in CONFIGS}
