"""Preflight checks: setups that make half-precision training fail, found before they do.

Plain functions over modules, optimizers and tensors (no Lightning import), usable in any
loop; :class:`amp_plugin.callbacks.PreflightChecks` runs them at the start of ``fit``. Each
returns a list of :class:`PreflightProblem` (empty when all is well) whose message names
the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from amp_plugin.dtypes import FP16_MIN_NORMAL, HALF_DTYPES

__all__ = [
    "CHECKS",
    "PreflightError",
    "PreflightProblem",
    "PreflightWarning",
    "check_anomaly_detection",
    "check_grad_scaler",
    "check_half_params_under_autocast",
    "check_loss_dtype",
    "check_optimizer_eps",
    "check_weight_range",
    "find_grad_scalers",
]

CHECKS = (
    "weight_range",
    "optimizer_eps",
    "half_params_autocast",
    "grad_scaler_half_grads",
    "half_loss",
    "anomaly_detection",
)
"""The check names, as used in :class:`PreflightProblem` and ``PreflightChecks(skip=...)``."""


class PreflightWarning(UserWarning):
    """A setup problem found by a preflight check (filter it with this category)."""


class PreflightError(RuntimeError):
    """A setup problem found by a preflight check in strict mode."""


@dataclass(frozen=True)
class PreflightProblem:
    """What a check found.

    Attributes:
        check: one of :data:`CHECKS`.
        message: the problem, then ``Fix:`` and what to do.
    """

    check: str
    message: str

    def __str__(self) -> str:
        return f"amp_plugin preflight [{self.check}]: {self.message}"


def _examples(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@torch.no_grad()
def check_weight_range(
    named_params: Iterable[tuple[str, torch.Tensor]], tiny_frac: float = 0.01
) -> list[PreflightProblem]:
    """Weights that FP16 cannot hold: any finite ``|w|`` that becomes inf in FP16 (``>= 65520``),
    or more than ``tiny_frac`` of the nonzero weights becoming zero or subnormal in FP16
    (``|w| < 2**-14``, about 6.1e-5). Both are typical of BF16-pretrained checkpoints.

    Args:
        named_params: ``(name, tensor)`` pairs of the weights that will be cast to FP16.
        tiny_frac: the tolerated share of nonzero weights that FP16 flushes or makes subnormal.
    """
    names, stats = [], []
    for name, p in named_params:
        if not p.is_floating_point() or p.numel() == 0:
            continue
        w = p.detach()
        h = w.to(torch.float16).abs()
        nonzero = w != 0
        stats.append(
            torch.stack(
                [
                    (torch.isinf(h) & torch.isfinite(w)).sum(),
                    ((h < FP16_MIN_NORMAL) & nonzero).sum(),
                    ((h == 0) & nonzero).sum(),
                    nonzero.sum(),
                ]
            )
            .double()
            .cpu()
        )
        names.append(name)
    if not stats:
        return []
    counts = torch.stack(stats).tolist()
    problems = []
    over = [n for n, c in zip(names, counts) if c[0]]
    if over:
        n_over = int(sum(c[0] for c in counts))
        problems.append(
            PreflightProblem(
                "weight_range",
                (
                    f"FP16 is chosen, but {n_over} weight value(s) exceed FP16's maximum 65504 and become inf "
                    f"in FP16 (in {_examples(over)}). Fix: train in bf16 (FP32's range; precision='bf16'), "
                    "which is what weights pretrained in BF16 expect."
                ),
            )
        )
    tiny, flushed, nonzero = (sum(c[i] for c in counts) for i in (1, 2, 3))
    if nonzero and tiny / nonzero > tiny_frac:
        worst = [n for n, c in sorted(zip(names, counts), key=lambda nc: -nc[1][1] / max(nc[1][3], 1)) if c[1]]
        problems.append(
            PreflightProblem(
                "weight_range",
                (
                    f"FP16 is chosen, but {tiny / nonzero:.1%} of the nonzero weights are below FP16's smallest "
                    f"normal value 6.1e-05 ({int(flushed)} flush to zero, the rest lose precision as subnormals; "
                    f"mostly in {_examples(worst)}). Fix: train in bf16 (precision='bf16'), which keeps FP32's "
                    "range; typical for checkpoints pretrained in BF16."
                ),
            )
        )
    return problems


def check_optimizer_eps(optimizer: torch.optim.Optimizer, name: str | None = None) -> list[PreflightProblem]:
    """An ``eps`` (Adam, AdamW, RMSprop, Adagrad, ...) that is 0 in the dtype of the parameters
    it updates, which is the dtype of the optimizer state: ``sqrt(v) + eps`` can then be 0 and
    the update inf/NaN. With :class:`~amp_plugin.MasterWeightOptimizer` the state is FP32.

    Args:
        optimizer: the optimizer (its ``param_groups`` hold the parameters it updates).
        name: how to call it in the message (default: its class name).
    """
    name = name or type(optimizer).__name__
    problems = []
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        values = eps if isinstance(eps, (tuple, list)) else (eps,)
        dtypes = sorted({p.dtype for p in group["params"] if p.dtype in HALF_DTYPES}, key=str)
        for dtype in dtypes:
            for e in values:
                if isinstance(e, (int, float)) and e > 0 and float(torch.tensor(e, dtype=dtype)) == 0:
                    problems.append(
                        PreflightProblem(
                            "optimizer_eps",
                            (
                                f"{name} param group {i} has eps={e!r}, which is 0 in {dtype}, the dtype of its "
                                "parameters and optimizer state: where the second moment is 0 the update divides by "
                                "zero (inf/NaN weights). Fix: use FP32 master weights "
                                "(MixedPrecisionPlugin(master_weights=True), FP32 optimizer state), or an eps "
                                f"representable in {dtype} (>= 6.1e-05 keeps it a normal number, e.g. eps=1e-4)."
                            ),
                        )
                    )
    return problems


def check_half_params_under_autocast(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[PreflightProblem]:
    """Parameters already in FP16/BF16 while autocast is on: autocast only casts FP32 down, so
    these layers train with half-precision weights, gradients and updates and no FP32 copy.

    Args:
        named_params: ``(name, param)`` pairs of the model that runs under autocast.
    """
    half = [(n, p.dtype) for n, p in named_params if p.dtype in HALF_DTYPES]
    if not half:
        return []
    dtypes = ", ".join(sorted({str(d) for _, d in half}))
    return [
        PreflightProblem(
            "half_params_autocast",
            (
                f"autocast is on, but {len(half)} parameter(s) are already {dtypes} "
                f"({_examples([n for n, _ in half])}): "
                "autocast does not give them an FP32 copy, so their updates are rounded in half precision "
                "(1.0 - 1e-4 == 1.0) and small gradients underflow. Fix: keep the model in FP32 (drop .half() / "
                ".to(torch.float16)) and let autocast cast the compute, or use "
                "MixedPrecisionPlugin(master_weights=True, autocast=False) for half weights with FP32 masters."
            ),
        )
    ]


def find_grad_scalers(module: nn.Module) -> list[tuple[str, torch.amp.GradScaler]]:
    """Enabled ``torch.amp.GradScaler`` instances held as attributes of ``module`` or its submodules."""
    found = []
    for prefix, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.amp.GradScaler) and value.is_enabled():
                found.append((f"{prefix}.{attr}" if prefix else attr, value))
    return found


def check_grad_scaler(
    scalers: Iterable[str], named_params: Iterable[tuple[str, torch.Tensor]]
) -> list[PreflightProblem]:
    """A ``torch.amp.GradScaler`` next to FP16 parameters: its ``unscale_`` raises
    "Attempting to unscale FP16 gradients.", and FP16 gradients underflow anyway.

    Args:
        scalers: where each GradScaler was found (e.g. ``"pl_module.scaler"``).
        named_params: the model's ``(name, param)`` pairs, as they will be trained.
    """
    scalers = list(scalers)
    fp16 = [n for n, p in named_params if p.dtype == torch.float16 and p.requires_grad]
    if not scalers or not fp16:
        return []
    return [
        PreflightProblem(
            "grad_scaler_half_grads",
            (
                f"a torch.amp.GradScaler ({', '.join(scalers)}) is used with {len(fp16)} FP16 parameter(s) "
                f"({_examples(fp16)}), whose gradients are FP16: GradScaler.unscale_ raises 'Attempting to unscale "
                "FP16 gradients.', and unscaled FP16 gradients underflow. Fix: use "
                "MixedPrecisionPlugin('fp16', master_weights=True) (its own loss scaler, FP32 master gradients) "
                "instead of the GradScaler, or keep the parameters in FP32 under autocast."
            ),
        )
    ]


def check_loss_dtype(loss: torch.Tensor, scale: float | None = None) -> list[PreflightProblem]:
    """A training loss computed in FP16/BF16: the reduction loses precision (and in FP16 can
    overflow), and its gradient is the loss scale itself, which FP16 cannot hold from 65520 on.

    Args:
        loss: the loss as the training step returned it.
        scale: the loss scale in use, if any (sharpens the message).
    """
    if not isinstance(loss, torch.Tensor) or loss.dtype not in HALF_DTYPES:
        return []
    why = "a mean over many terms in half precision loses accuracy"
    if loss.dtype == torch.float16:
        why += " and can overflow (max 65504)"
        if scale is not None and scale >= 65520:
            why += (
                f"; with the loss scale {scale:g}, the gradient reaching the FP16 loss is {scale:g}, "
                "which is inf in FP16, so steps are skipped until the scale backs off"
            )
        else:
            why += ", and a loss scale of 2**16 makes its gradient inf in FP16"
    return [
        PreflightProblem(
            "half_loss",
            (
                f"the training loss is {loss.dtype}: {why}. Fix: compute the loss in FP32, e.g. "
                "F.cross_entropy(logits.float(), targets)."
            ),
        )
    ]


def check_anomaly_detection(dynamic_scaling: bool, enabled: bool | None = None) -> list[PreflightProblem]:
    """Autograd anomaly detection together with dynamic loss scaling.

    A dynamic scaler finds its scale by overflowing now and then (at the start, after every
    growth): those steps are meant to be skipped. Anomaly detection raises inside ``backward``
    as soon as a gradient turns NaN, so the first such overflow (inf - inf in a matmul's
    backward, say) stops the run instead of being skipped.

    Args:
        dynamic_scaling: whether a scaler that backs off on overflow is in use.
        enabled: whether anomaly detection is on (default: ``torch.is_anomaly_enabled()``).
    """
    enabled = torch.is_anomaly_enabled() if enabled is None else enabled
    if not (enabled and dynamic_scaling):
        return []
    return [
        PreflightProblem(
            "anomaly_detection",
            (
                "autograd anomaly detection is on (torch.autograd.set_detect_anomaly(True) or "
                "Trainer(detect_anomaly=True)) together with dynamic loss scaling: the overflows the scaler "
                "expects and skips (the first steps, and after each growth) become NaN gradients, and anomaly "
                "detection raises on them inside backward. Fix: turn anomaly detection off while training with a "
                "loss scaler, or debug with precision='bf16' (no loss scaling), or a StaticLossScaler small enough "
                "never to overflow."
            ),
        )
    ]
