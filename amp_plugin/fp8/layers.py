"""Converting a model's ``nn.Linear`` layers to FP8, and the step-level state of those layers.

:func:`convert_to_fp8` swaps each eligible ``nn.Linear`` for an :class:`~amp_plugin.fp8.Fp8Linear`
(and each ``transformers``-style ``Conv1D`` for an :class:`~amp_plugin.fp8.Fp8Conv1D`) holding the
same parameters and returns an :class:`Fp8Layers`, which does what happens once per optimizer step
(the delayed scale update, the fallback rule), reads the statistics, says which layers run in FP8
(:meth:`Fp8Layers.summary`), and saves and restores the amax histories. A plain loop::

    fp8 = convert_to_fp8(model, Fp8Recipe())
    for batch in data:
        loss = model(batch).sum(); loss.backward()
        optimizer.step(); optimizer.zero_grad()
        fp8.update()          # once per optimizer step, like GradScaler.update()
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from amp_plugin.checks import check_type
from amp_plugin.fp8.conv1d import Fp8Conv1D
from amp_plugin.fp8.linear import AMAX, FLUSHED, NUMEL, OPERANDS, SATURATED, Fp8Linear, Fp8Module
from amp_plugin.fp8.recipe import Fp8Recipe, compute_scale
from amp_plugin.fp8.select import (
    check_keep_bf16,
    classify,
    describe_summary,
    layer_type,
    reason_counts,
    warn_if_nothing_converted,
)

__all__ = ["Fallback", "Fp8Layers", "Fp8Stat", "convert_to_fp8", "distributed_max"]

log = logging.getLogger("amp_plugin.fp8")

Reduce = Callable[[Tensor], None]
"""An in-place max-reduction of a tensor across ranks (``None``: a single process)."""


@dataclass(frozen=True)
class Fp8Stat:
    """One layer's operand over the steps since the last read (a row of ``fp8_stats.csv``).

    Attributes:
        layer: the qualified module name.
        operand: ``"input"``, ``"weight"`` or ``"grad_output"``.
        amax: the largest ``|x|`` seen.
        scale: the scale in use at the read.
        saturated_frac: the fraction of values clamped to the format's max.
        flushed_frac: the fraction of values non-zero before the cast and zero after it.
        numel: the number of values cast.
    """

    layer: str
    operand: str
    amax: float
    scale: float
    saturated_frac: float
    flushed_frac: float
    numel: int


@dataclass(frozen=True)
class Fallback:
    """A layer that went back to BF16: its name, the step (:attr:`Fp8Layers.steps`) and the
    steps in a row its saturated fraction had stayed above the bound."""

    layer: str
    step: int
    steps_above: int


def distributed_max(tensor: Tensor) -> None:
    """All-reduce ``tensor`` with ``MAX`` over the default process group (TE's ``reduce_amax``)."""
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)


def _default_reduce(recipe: Fp8Recipe) -> Reduce | None:
    dist = torch.distributed
    if recipe.reduce_amax and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return distributed_max
    return None


_RECIPE_OR_NONE = "an amp_plugin.fp8.Fp8Recipe or None (the default recipe)"


def _check_reduce(reduce: Any) -> None:
    if reduce is not None and not callable(reduce):
        raise TypeError(
            f"reduce={reduce!r} ({type(reduce).__name__}) is not allowed: reduce must be a callable that "
            "max-reduces a tensor in place across ranks (such as amp_plugin.fp8.distributed_max), or None."
        )


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | None = None, reduce: Reduce | None = None) -> Fp8Layers:
    """Swap ``model``'s eligible linear layers (:func:`~amp_plugin.fp8.eligible`) for FP8 ones in
    place: ``nn.Linear`` -> :class:`Fp8Linear`, ``transformers``' ``Conv1D`` ->
    :class:`~amp_plugin.fp8.Fp8Conv1D`, each holding the layer's own Parameters; layers already
    converted are kept. Only exact ``nn.Linear`` instances convert (subclasses such as
    attention's ``out_proj`` are read by other code).

    A ``keep_bf16`` pattern that matches no linear layer is a ``ValueError`` naming it and the
    layers there are; a model of which no layer converts gets a
    :class:`~amp_plugin.fp8.Fp8NothingConvertedWarning`.

    Args:
        model: the model, whose parameters may already be BF16.
        recipe: the :class:`Fp8Recipe` (default: ``Fp8Recipe()``).
        reduce: how amaxes are max-reduced across ranks; default: :func:`distributed_max` when
            ``torch.distributed`` runs more than one process and ``recipe.reduce_amax``.

    Raises:
        TypeError: ``model`` is no ``nn.Module``, ``recipe`` no :class:`Fp8Recipe` or None, or
            ``reduce`` not callable or None; the message names the argument and the value's type.
    """
    check_type("model", model, nn.Module, "a torch.nn.Module (the model whose linear layers convert)")
    recipe = Fp8Recipe() if recipe is None else check_type("recipe", recipe, Fp8Recipe, _RECIPE_OR_NONE)
    _check_reduce(reduce)
    check_keep_bf16(model, recipe)
    verdicts = classify(model, recipe)
    for name, verdict in verdicts.items():
        module = model.get_submodule(name)
        if verdict.kind != "fp8" or isinstance(module, Fp8Module):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if type(module) is nn.Linear:
            setattr(parent, child, Fp8Linear.from_linear(module, recipe))
        else:
            setattr(parent, child, Fp8Conv1D.from_conv1d(module, recipe))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Module)}
    kinds = {n: "fp8" if n in layers else v.kind for n, v in verdicts.items()}  # converted before: FP8
    warn_if_nothing_converted(kinds)
    types = {n: layer_type(model.get_submodule(n)) for n in verdicts}
    kept = {n: kind for n, kind in kinds.items() if kind != "fp8"}
    return Fp8Layers(layers, recipe, reduce, kept=kept, types=types)


class Fp8Layers:
    """The FP8 layers of a model, and what is done to them once per optimizer step.

    Args:
        layers: the FP8 layers (:class:`~amp_plugin.fp8.Fp8Module`) by qualified name.
        recipe: their recipe.
        reduce: an in-place max-reduction across ranks, or ``None`` (see :func:`convert_to_fp8`).
        kept: the linear layers left in BF16 by name, with their reason (a key of
            :data:`~amp_plugin.fp8.BF16_REASONS`); :func:`convert_to_fp8` fills it.
        types: ``"Linear"`` or ``"Conv1D"`` per layer name (default: from the layers).

    Attributes:
        steps: the :meth:`update` calls so far (optimizer steps, skipped ones included).
        fallbacks: the layers that went back to BF16, in order (:class:`Fallback`).
    """

    def __init__(
        self,
        layers: Mapping[str, Fp8Module],
        recipe: Fp8Recipe,
        reduce: Reduce | None = None,
        *,
        kept: Mapping[str, str] | None = None,
        types: Mapping[str, str] | None = None,
    ) -> None:
        check_type("layers", layers, Mapping, "a mapping of qualified names to amp_plugin.fp8.Fp8Module layers")
        for name, layer in layers.items():
            check_type(f"layers[{name!r}]", layer, Fp8Module, "an amp_plugin.fp8.Fp8Module (see convert_to_fp8)")
        check_type("recipe", recipe, Fp8Recipe, "an amp_plugin.fp8.Fp8Recipe")
        _check_reduce(reduce)
        self.layers = dict(layers)
        self.recipe = recipe
        self.reduce = reduce if reduce is not None else _default_reduce(recipe)
        self.kept = dict(kept or {})
        self.types = {name: layer_type(m) for name, m in self.layers.items()}
        self.types.update(types or {})
        self.steps = 0
        self.fallbacks: list[Fallback] = []

    def active(self) -> list[Fp8Module]:
        return [m for m in self.layers.values() if m.fp8_active]

    @torch.no_grad()
    def update(self, skipped: bool = False) -> None:
        """End of an optimizer step: delayed scales from the amax histories (amaxes max-reduced
        across ranks first, in one collective), histories rolled, the fallback counters
        advanced; every ``fallback_steps`` steps, one host read of those counters.

        A step is dropped from a layer's FP8 state when one of the layer's amaxes of the step is
        not finite (a NaN or inf batch; on any rank): its history is not rolled, its scales and
        its fallback counter stay, as if the step had not happened (Transformer Engine's amax
        reduction drops a NaN too). That is decided on the device, without a host sync.
        ``skipped=True`` (the optimizer step was skipped, e.g. ``scaler.last_step_skipped``)
        drops the step for every layer whatever its amaxes."""
        recipe = self.recipe
        active = self.active()
        self.steps += 1
        if not active:
            return
        if skipped:
            for m in active:
                m.fp8_amax_history[0].zero_()
                m.fp8_step_counts.zero_()
                if m.fp8_fresh:  # as a layer that never stepped
                    m.fp8_scale.fill_(1.0)
            return
        current = torch.stack([m.fp8_amax_history[0] for m in active])  # [layers, 3]
        # NaN may not survive a MAX reduction (fmax semantics); inf does, so every rank agrees.
        current = torch.where(torch.isfinite(current), current, torch.full_like(current, math.inf))
        if recipe.scaling == "delayed" and self.reduce is not None:
            self.reduce(current)
        finite = ~torch.isinf(current).any(dim=1)  # [layers]: this step counts for the layer
        if recipe.scaling == "delayed":
            for m, amax_now, ok in zip(active, current, finite):
                history = m.fp8_amax_history
                history[0] = amax_now
                amax = history.amax(dim=0) if recipe.amax_compute_algo == "max" else history[0]
                scale = compute_scale(amax, m.fp8_scale, m.fp8_max, recipe.margin, recipe.amax_floor)
                m.fp8_scale.copy_(torch.where(ok, scale, m.fp8_scale))
                history.copy_(torch.where(ok, history.roll(-1, dims=0), history))
                history[0].zero_()
            self._end_fresh(active, finite)
        else:
            for m in active:
                m.fp8_amax_history[0].zero_()
        if recipe.fallback_steps:
            for m, ok in zip(active, finite):
                counts = m.fp8_step_counts
                # too many values saturated, or a cast that flushed every non-zero value to zero
                above = (counts[:, 0] > recipe.fallback_saturation * counts[:, 1]).any() | (counts[:, 2] > 0).any()
                advanced = torch.where(above, m.fp8_over_steps + 1, torch.zeros_like(m.fp8_over_steps))
                m.fp8_over_steps.copy_(torch.where(ok, advanced, m.fp8_over_steps))
                counts.zero_()
            if self.steps % recipe.fallback_steps == 0:
                self._check_fallbacks(active)
        else:
            for m in active:
                m.fp8_step_counts.zero_()

    @staticmethod
    def _end_fresh(active: list[Fp8Module], finite: Tensor) -> None:
        """A layer's first counted step ends its fresh start (casts with each tensor's own amax).
        Read on the host while some layer is fresh: the first update(s) only."""
        fresh = [(m, i) for i, m in enumerate(active) if m.fp8_fresh]
        if not fresh:
            return
        counted = finite.tolist()
        for m, i in fresh:
            if counted[i]:
                m.fp8_fresh = False
            else:  # its only step was dropped: start again as a layer that never stepped
                m.fp8_scale.fill_(1.0)

    # ------------------------------------------------------------------ what runs in FP8
    def summary(self) -> dict[str, Any]:
        """Which linear layers run in FP8 now and why the others are BF16 (``summary.json``'s ``fp8``)::

        {"layers": 6, "fp8": 3, "bf16": 3,
         "fp8_types": {"Linear": 2, "Conv1D": 1},
         "bf16_reasons": {"first_last": 2, "fell_back": 1},
         "bf16_layers": {"embed": "first_last", "head": "first_last", "mlp.0": "fell_back"}}
        """
        bf16 = dict(self.kept)
        bf16.update({name: "fell_back" for name, m in self.layers.items() if not m.fp8_active})
        fp8 = [name for name, m in self.layers.items() if m.fp8_active]
        types = [self.types.get(name, "Linear") for name in fp8]
        return {
            "layers": len(fp8) + len(bf16),
            "fp8": len(fp8),
            "bf16": len(bf16),
            "fp8_types": {t: types.count(t) for t in ("Linear", "Conv1D") if t in types},
            "bf16_reasons": reason_counts(bf16.values()),
            "bf16_layers": bf16,
        }

    def describe(self) -> str:
        """:meth:`summary` in a line: ``"3 of 6 linear layers in FP8 (2 Linear, 1 Conv1D); 3 in BF16: ..."``."""
        return describe_summary(self.summary())

    def _check_fallbacks(self, active: list[Fp8Module]) -> None:
        over = torch.stack([m.fp8_over_steps for m in active])
        if self.reduce is not None:  # every rank falls back together
            self.reduce(over)
        names = {id(m): n for n, m in self.layers.items()}
        for m, steps_above in zip(active, over.tolist()):  # the one host sync
            if steps_above >= self.recipe.fallback_steps:
                self._fall_back(m, names[id(m)], int(steps_above))

    def _fall_back(self, layer: Fp8Module, name: str, steps_above: int) -> None:
        layer.fp8_active = False
        self.fallbacks.append(Fallback(name, self.steps, steps_above))
        log.warning(
            "FP8: layer %r falls back to BF16 at step %d: over %g of an operand's values saturated, or all of "
            "them flushed to zero, for %d steps in a row (fallback_saturation, fallback_steps). Its scales stop "
            "updating; keep it in BF16 from the start with keep_bf16=[%r].",
            name,
            self.steps,
            self.recipe.fallback_saturation,
            steps_above,
            name,
        )

    @torch.no_grad()
    def read_stats(self, reset: bool = True) -> list[Fp8Stat]:
        """Per active layer and operand, the statistics since the last read (one host sync);
        ``reset`` starts a new window."""
        named = [(n, m) for n, m in self.layers.items() if m.fp8_active]
        if not named:
            return []
        stats = torch.stack([m.fp8_stats for _, m in named]).tolist()
        scales = torch.stack([m.fp8_scale for _, m in named]).tolist()
        rows = []
        for (name, m), layer_stats, layer_scales in zip(named, stats, scales):
            for operand, values, scale in zip(OPERANDS, layer_stats, layer_scales):
                numel = values[NUMEL]
                rows.append(
                    Fp8Stat(
                        name,
                        operand,
                        values[AMAX],
                        scale,
                        values[SATURATED] / numel if numel else 0.0,
                        values[FLUSHED] / numel if numel else 0.0,
                        int(numel),
                    )
                )
            if reset:
                m.fp8_stats.zero_()
        return rows

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The amax histories, scales and fallback counters of every layer (copies)."""
        return {
            "version": 1,
            "recipe": asdict(self.recipe),
            "steps": self.steps,
            "layers": {
                name: {
                    "amax_history": m.fp8_amax_history.detach().cpu().clone(),
                    "scale": m.fp8_scale.detach().cpu().clone(),
                    "over_steps": m.fp8_over_steps.detach().cpu().clone(),
                    "fp8_active": m.fp8_active,
                    "fresh": m.fp8_fresh,
                }
                for name, m in self.layers.items()
            },
            "fallbacks": [asdict(f) for f in self.fallbacks],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. The same layers must be FP8 (a ``ValueError`` names the
        difference); a history of another length is an error too."""
        saved = state["layers"]
        if set(saved) != set(self.layers):
            missing, extra = sorted(set(self.layers) - set(saved)), sorted(set(saved) - set(self.layers))
            raise ValueError(
                f"the FP8 state does not match this model's FP8 layers: not in the state {missing}, "
                f"not FP8 here {extra}. Convert the same layers (keep_bf16, keep_first_last, min_features)."
            )
        for name, m in self.layers.items():
            entry = saved[name]
            if entry["amax_history"].shape != m.fp8_amax_history.shape:
                raise ValueError(
                    f"layer {name!r}: saved amax history of shape {tuple(entry['amax_history'].shape)}, "
                    f"this run's is {tuple(m.fp8_amax_history.shape)} (amax_history_len or scaling changed)."
                )
            m.fp8_amax_history.copy_(entry["amax_history"])
            m.fp8_scale.copy_(entry["scale"])
            m.fp8_over_steps.copy_(entry["over_steps"])
            m.fp8_active = bool(entry["fp8_active"])
            m.fp8_fresh = bool(entry.get("fresh", False))
        self.steps = int(state["steps"])
        self.fallbacks = [Fallback(**f) for f in state.get("fallbacks", [])]
