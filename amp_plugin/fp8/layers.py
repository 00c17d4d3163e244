"""Converting a model's ``nn.Linear`` layers to FP8, and the step-level state of those layers.

:func:`convert_to_fp8` swaps each eligible ``nn.Linear`` for an :class:`~amp_plugin.fp8.Fp8Linear`
holding the same parameters and returns an :class:`Fp8Layers`, which does what happens once per
optimizer step (the delayed scale update, the fallback rule), reads the statistics, and saves
and restores the amax histories. A plain loop::

    fp8 = convert_to_fp8(model, Fp8Recipe())
    for batch in data:
        loss = model(batch).sum(); loss.backward()
        optimizer.step(); optimizer.zero_grad()
        fp8.update()          # once per optimizer step, like GradScaler.update()
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from amp_plugin.fp8.linear import AMAX, FLUSHED, NUMEL, OPERANDS, SATURATED, Fp8Linear
from amp_plugin.fp8.recipe import Fp8Recipe, compute_scale

__all__ = ["Fallback", "Fp8Layers", "Fp8Stat", "convert_to_fp8", "distributed_max", "eligible"]

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


def eligible(model: nn.Module, recipe: Fp8Recipe) -> dict[str, str]:
    """Each ``nn.Linear`` of ``model`` by qualified name: ``"fp8"``, or why it stays BF16."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, Fp8Linear)]
    ends = {linears[0][0], linears[-1][0]} if linears and recipe.keep_first_last else set()
    verdict = {}
    for name, m in linears:
        pattern = next((p for p in recipe.keep_bf16 if fnmatch.fnmatchcase(name, p)), None)
        small = min(m.in_features, m.out_features) < recipe.min_features
        odd = m.in_features % recipe.multiple_of or m.out_features % recipe.multiple_of
        if name in ends:
            verdict[name] = "first or last linear layer (keep_first_last)"
        elif pattern is not None:
            verdict[name] = f"matches keep_bf16 pattern {pattern!r}"
        elif small:
            verdict[name] = f"smaller than min_features={recipe.min_features}"
        elif odd:
            verdict[name] = f"features not a multiple of {recipe.multiple_of}"
        else:
            verdict[name] = "fp8"
    return verdict


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | None = None, reduce: Reduce | None = None) -> Fp8Layers:
    """Swap ``model``'s eligible ``nn.Linear`` layers (:func:`eligible`) for :class:`Fp8Linear`
    in place; layers already converted are kept. Only exact ``nn.Linear`` instances convert
    (subclasses such as attention's ``out_proj`` are read by other code).

    Args:
        model: the model, whose parameters may already be BF16.
        recipe: the :class:`Fp8Recipe` (default: ``Fp8Recipe()``).
        reduce: how amaxes are max-reduced across ranks; default: :func:`distributed_max` when
            ``torch.distributed`` runs more than one process and ``recipe.reduce_amax``.
    """
    recipe = recipe or Fp8Recipe()
    for name, verdict in eligible(model, recipe).items():
        if verdict != "fp8" or isinstance(model.get_submodule(name), Fp8Linear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), recipe))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    return Fp8Layers(layers, recipe, reduce)


class Fp8Layers:
    """The FP8 layers of a model, and what is done to them once per optimizer step.

    Args:
        layers: the :class:`Fp8Linear` modules by qualified name.
        recipe: their recipe.
        reduce: an in-place max-reduction across ranks, or ``None`` (see :func:`convert_to_fp8`).

    Attributes:
        steps: the :meth:`update` calls so far (optimizer steps).
        fallbacks: the layers that went back to BF16, in order (:class:`Fallback`).
    """

    def __init__(self, layers: dict[str, Fp8Linear], recipe: Fp8Recipe, reduce: Reduce | None = None) -> None:
        self.layers = dict(layers)
        self.recipe = recipe
        self.reduce = reduce if reduce is not None else _default_reduce(recipe)
        self.steps = 0
        self.fallbacks: list[Fallback] = []

    def active(self) -> list[Fp8Linear]:
        return [m for m in self.layers.values() if m.fp8_active]

    @torch.no_grad()
    def update(self) -> None:
        """End of an optimizer step: delayed scales from the amax histories (amaxes max-reduced
        across ranks first, in one collective), histories rolled, the fallback counters
        advanced; every ``fallback_steps`` steps, one host read of those counters."""
        recipe = self.recipe
        active = self.active()
        self.steps += 1
        if not active:
            return
        if recipe.scaling == "delayed":
            current = torch.stack([m.fp8_amax_history[0] for m in active])  # [layers, 3]
            if self.reduce is not None:
                self.reduce(current)
            for m, amax_now in zip(active, current):
                history = m.fp8_amax_history
                history[0] = amax_now
                amax = history.amax(dim=0) if recipe.amax_compute_algo == "max" else history[0]
                m.fp8_scale.copy_(compute_scale(amax, m.fp8_scale, m.fp8_max, recipe.margin, recipe.amax_floor))
                history.copy_(history.roll(-1, dims=0))
                history[0].zero_()
                m.fp8_fresh = False
        if recipe.fallback_steps:
            for m in active:
                counts = m.fp8_step_counts
                above = (counts[:, 0] > recipe.fallback_saturation * counts[:, 1]).any()
                m.fp8_over_steps.copy_(torch.where(above, m.fp8_over_steps + 1, torch.zeros_like(m.fp8_over_steps)))
                counts.zero_()
            if self.steps % recipe.fallback_steps == 0:
                self._check_fallbacks(active)
        else:
            for m in active:
                m.fp8_step_counts.zero_()

    def _check_fallbacks(self, active: list[Fp8Linear]) -> None:
        over = torch.stack([m.fp8_over_steps for m in active])
        if self.reduce is not None:  # every rank falls back together
            self.reduce(over)
        names = {id(m): n for n, m in self.layers.items()}
        for m, steps_above in zip(active, over.tolist()):  # the one host sync
            if steps_above >= self.recipe.fallback_steps:
                self._fall_back(m, names[id(m)], int(steps_above))

    def _fall_back(self, layer: Fp8Linear, name: str, steps_above: int) -> None:
        layer.fp8_active = False
        self.fallbacks.append(Fallback(name, self.steps, steps_above))
        log.warning(
            "FP8: layer %r falls back to BF16 at step %d: over %g of its values saturated for %d steps in a row "
            "(fallback_saturation, fallback_steps). Its scales stop updating; keep it in BF16 from the start "
            "with keep_bf16=[%r].",
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
