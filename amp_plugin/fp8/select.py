"""Which layers of a model run in FP8, and why the others stay BF16.

The candidates are the model's linear layers: exact ``nn.Linear`` instances (a subclass such as
attention's ``out_proj`` is read by other code) and ``transformers``-style ``Conv1D`` layers
(:func:`~amp_plugin.fp8.is_conv1d`), in module order. Each gets a :class:`Verdict`: ``"fp8"``,
or the reason it stays BF16 (:data:`BF16_REASONS`). :func:`check_keep_bf16` refuses a
``keep_bf16`` pattern that matches no candidate, and :func:`warn_if_nothing_converted` warns
(:class:`Fp8NothingConvertedWarning`) when no layer would run in FP8.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from amp_plugin.checks import check_type
from amp_plugin.fp8.conv1d import Fp8Conv1D, is_conv1d
from amp_plugin.fp8.linear import Fp8Module
from amp_plugin.fp8.recipe import Fp8Recipe

__all__ = [
    "BF16_REASONS",
    "Fp8NothingConvertedWarning",
    "Verdict",
    "candidates",
    "check_keep_bf16",
    "classify",
    "describe_reasons",
    "describe_summary",
    "eligible",
    "layer_type",
    "reason_counts",
    "warn_if_nothing_converted",
]

BF16_REASONS = {
    "first_last": "first/last layer (keep_first_last)",
    "keep_bf16": "keep_bf16 pattern",
    "min_features": "below min_features",
    "multiple_of": "features not a multiple of multiple_of",
    "fell_back": "fell back to BF16 (saturation)",
}
"""Why a linear layer computes in BF16, by key (the keys of ``summary.json``'s ``bf16_reasons``)."""


class Fp8NothingConvertedWarning(UserWarning):
    """``precision="fp8"`` on a model none of whose layers runs in FP8: the run is a BF16 run."""


@dataclass(frozen=True)
class Verdict:
    """One candidate layer: ``kind`` is ``"fp8"`` or a key of :data:`BF16_REASONS`; ``reason``
    says it in words (the value :func:`eligible` returns)."""

    kind: str
    reason: str


def layer_type(module: nn.Module) -> str:
    """``"Linear"`` or ``"Conv1D"``: the kind of linear layer ``module`` is (or was, converted)."""
    return "Conv1D" if isinstance(module, Fp8Conv1D) or is_conv1d(module) else "Linear"


def candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linear layers that may convert, by qualified name in module order (converted ones included)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear or isinstance(m, Fp8Module) or is_conv1d(m)
    ]


def _features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, (nn.Linear, Fp8Module)):
        return module.in_features, module.out_features
    weight: Tensor = module.weight  # type: ignore[assignment]  # Conv1D: [in, out] (is_conv1d)
    return int(weight.shape[0]), int(weight.shape[1])


def classify(model: nn.Module, recipe: Fp8Recipe) -> dict[str, Verdict]:
    """Each candidate layer of ``model`` (:func:`candidates`) by qualified name, with its :class:`Verdict`.

    Raises:
        TypeError: ``model`` is no ``nn.Module`` or ``recipe`` no :class:`~amp_plugin.fp8.Fp8Recipe`.
    """
    check_type("model", model, nn.Module, "a torch.nn.Module (the model whose linear layers convert)")
    check_type("recipe", recipe, Fp8Recipe, "an amp_plugin.fp8.Fp8Recipe")
    layers = candidates(model)
    ends = {layers[0][0], layers[-1][0]} if layers and recipe.keep_first_last else set()
    verdicts = {}
    for name, m in layers:
        pattern = next((p for p in recipe.keep_bf16 if fnmatch.fnmatchcase(name, p)), None)
        n_in, n_out = _features(m)
        if name in ends:
            verdicts[name] = Verdict("first_last", "first or last linear layer (keep_first_last)")
        elif pattern is not None:
            verdicts[name] = Verdict("keep_bf16", f"matches keep_bf16 pattern {pattern!r}")
        elif min(n_in, n_out) < recipe.min_features:
            verdicts[name] = Verdict("min_features", f"smaller than min_features={recipe.min_features}")
        elif n_in % recipe.multiple_of or n_out % recipe.multiple_of:
            verdicts[name] = Verdict("multiple_of", f"features not a multiple of {recipe.multiple_of}")
        else:
            verdicts[name] = Verdict("fp8", "fp8")
    return verdicts


def eligible(model: nn.Module, recipe: Fp8Recipe) -> dict[str, str]:
    """Each linear layer (``nn.Linear`` or ``Conv1D``) of ``model`` by qualified name: ``"fp8"``,
    or why it stays BF16."""
    return {name: v.reason for name, v in classify(model, recipe).items()}


def _sample(names: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def check_keep_bf16(model: nn.Module, recipe: Fp8Recipe) -> None:
    """A ``ValueError`` for a ``keep_bf16`` pattern that matches none of ``model``'s linear
    layers (a typo would otherwise leave the layer in FP8 without a word); the message names the
    pattern and the layers there are."""
    names = [name for name, _ in candidates(model)]
    for pattern in recipe.keep_bf16:
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            continue
        hint = ""
        module = next((m for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)), None)
        if module is not None:
            hint = (
                f" It names a module ({type(module).__name__}), not a linear layer: {pattern + '.*'!r} keeps "
                "the linear layers inside it."
            )
        there = (
            f"The model's {len(names)} linear layers: {_sample(names)}."
            if names
            else ("The model has no nn.Linear or Conv1D layer.")
        )
        raise ValueError(
            f"keep_bf16={list(recipe.keep_bf16)!r} is not allowed: its pattern {pattern!r} matches no linear layer "
            "of the model, so it would keep nothing in BF16 (patterns are fnmatch patterns of qualified module "
            f"names, e.g. 'model.lm_head' or '*.attn.*').{hint} {there}"
        )


def reason_counts(kinds: Iterable[str]) -> dict[str, int]:
    """How many layers per BF16 reason, in the order of :data:`BF16_REASONS` (none left out of the count)."""
    counts = Counter(kinds)
    return {key: counts[key] for key in BF16_REASONS if counts[key]}


def describe_reasons(counts: Mapping[str, int]) -> str:
    """``{"first_last": 2, "keep_bf16": 1}`` -> ``"2 first/last layer (keep_first_last), 1 keep_bf16 pattern"``."""
    return ", ".join(f"{n} {BF16_REASONS[key]}" for key, n in counts.items())


def describe_summary(summary: Mapping[str, Any]) -> str:
    """:meth:`~amp_plugin.fp8.Fp8Layers.summary` in a line, e.g. ``"3 of 6 linear layers in FP8
    (2 Linear, 1 Conv1D); 3 in BF16: 2 first/last layer (keep_first_last), 1 keep_bf16 pattern"``."""
    n, total = summary["fp8"], summary["layers"]
    if total == 0:
        return "none: the model has no nn.Linear or Conv1D layer, every GEMM ran in BF16"
    text = f"{n} of {total} linear layers in FP8"
    types = summary.get("fp8_types") or {}
    if n:
        text += " (" + ", ".join(f"{count} {kind}" for kind, count in types.items()) + ")"
    if summary["bf16"]:
        text += f"; {summary['bf16']} in BF16: {describe_reasons(summary['bf16_reasons'])}"
    if not n:
        text += " (no FP8 GEMM: this run computed as bf16 does)"
    return text


def warn_if_nothing_converted(kinds: Mapping[str, str]) -> None:
    """:class:`Fp8NothingConvertedWarning` when no layer of ``kinds`` (name -> ``"fp8"`` or a BF16
    reason key, every linear layer of the model) runs in FP8."""
    if any(kind == "fp8" for kind in kinds.values()):
        return
    if not kinds:
        what = "the model has no nn.Linear or Conv1D layer (convolutions and other layers stay BF16)"
    else:
        what = (
            f"all {len(kinds)} of its linear layers stay BF16 ({describe_reasons(reason_counts(kinds.values()))}: "
            f"{_sample(list(kinds), 4)})"
        )
    warnings.warn(
        f"precision='fp8' runs no GEMM in FP8: {what}, so the run computes as precision='bf16' does. To run layers "
        "in FP8, see which keep them in BF16 with amp_plugin.fp8.eligible(model, recipe) and relax keep_first_last, "
        "keep_bf16, min_features or multiple_of.",
        Fp8NothingConvertedWarning,
        stacklevel=3,
    )
