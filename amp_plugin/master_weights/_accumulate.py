"""Gradient accumulation in FP32 for half-precision parameters with FP32 masters.

Autograd accumulates a half-precision parameter's gradients in its own dtype: after 16 BF16
micro-batches the sum has been rounded 15 times (about twice the error of one micro-batch's
gradient, against a float64 sum). Lightning's ``bf16-mixed``, Megatron and DeepSpeed sum in
FP32. So does a :class:`~amp_plugin.MasterWeightOptimizer`, and only when gradients really
are accumulated:

- the first backward after ``zero_grad`` leaves the half gradient as autograd made it and
  keeps nothing else (16 bytes of training state per parameter with AdamW stay true);
- each further backward before the step adds the incoming gradient to an FP32 sum (made from
  the half gradient on the second backward: 4 bytes per parameter for the rest of the window)
  and writes the sum, rounded once, into the model's gradient, so whatever reads the model's
  gradient (a hook, DDP's reducer, a monitor) sees the best half-precision value;
- the step uses the FP32 sum as the master gradient (unscaled, with the inf/NaN check), and
  frees it. An FP16 sum that overflows FP16's range where the model's gradient shows inf is an
  overflow there too (the scale backs off), so the model's gradient and the master's agree on
  what overflowed.

The sum is used only while the model's gradient is still the tensor it last wrote, unchanged
since (its ``_version``): anything else that wrote the gradient since (an edit by user code,
DDP's all-reduce writing the averaged gradient back, ``p.grad = ...``) wins, and the step reads
the model's gradient as before. So under DDP the all-reduced half gradient is what is stepped.

Two autograd hooks per parameter, registered once (shared by every wrapper over it): a
pre-hook on the parameter's gradient accumulator (the ``AccumulateGrad`` node, kept alive as
DDP keeps it) sees the incoming gradient after every tensor hook (``p.register_hook``) has
changed it and before autograd adds it; a post-accumulate hook writes the rounded sum after.
Sparse gradients and double backward (``create_graph=True``) are left to autograd.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["attach", "by_backward", "detach_sum", "sum_for"]


class _Sum:
    """One parameter's FP32 sum over the current accumulation window."""

    __slots__ = ("holders", "mark", "value", "waiting")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None  # the FP32 sum of every micro-batch's gradient so far
        self.mark: tuple[torch.Tensor, int] | None = None  # the model gradient it last wrote, and its version
        self.waiting = False  # the pre-hook added a gradient; the post-accumulate hook writes it
        # the wrappers keeping the hooked gradient accumulator alive (autograd holds it weakly)
        self.holders: weakref.WeakSet = weakref.WeakSet()

    def ours(self, grad: torch.Tensor | None) -> bool:
        mark = self.mark
        return mark is not None and grad is mark[0] and grad._version == mark[1]

    def clear(self) -> None:
        self.value = self.mark = None
        self.waiting = False

    def __reduce__(self) -> tuple[type, tuple[()]]:
        """A copy (pickling, ``copy.deepcopy`` of the optimizer) starts with no window under way: the
        hooks, the window and the holders belong to the original's autograd graph."""
        return (_Sum, ())


def attach(param: torch.Tensor, record: Any, holder: Any, keep: list[Any]) -> None:
    """Give ``param`` (a half-precision leaf) its accumulation hooks, keeping the sum in
    ``record.acc`` and the hooked accumulator node in ``keep`` (a list ``holder`` owns: the
    node lives as long as ``holder``). Nothing is registered while another live holder keeps
    the hooks; a second registration (after every holder went) is harmless: the hooks act once
    per backward. A parameter that cannot take hooks is left to autograd."""
    acc = record.acc
    if acc is None:
        acc = record.acc = _Sum()
    elif len(acc.holders):
        keep.append(None)  # the hooks are kept alive elsewhere
        acc.holders.add(holder)
        return
    ref = weakref.ref(param)

    def before(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        incoming, p = grad_outputs[0], ref()
        if incoming is None or acc.waiting:
            return
        existing = None if p is None else p.grad
        if existing is None or incoming.requires_grad or incoming.is_sparse or existing.is_sparse:
            acc.clear()  # the first micro-batch (or one autograd keeps): nothing to sum
            return
        with torch.no_grad():
            if acc.value is None or not acc.ours(existing):
                acc.value = existing.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            acc.value.add_(incoming)
        acc.waiting = True

    def after(p: torch.Tensor) -> None:
        grad = p.grad
        if not acc.waiting:
            return
        acc.waiting = False
        if grad is None or acc.value is None:
            return
        with torch.no_grad():
            grad.copy_(acc.value)
        acc.mark = (grad, grad._version)

    frozen = not param.requires_grad
    try:
        if frozen:
            param.requires_grad_(True)  # hooks need it; they stay when it is turned off again
        with torch.enable_grad():  # (the optimizer may be built under no_grad)
            node: Any = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        node.register_prehook(before)
        param.register_post_accumulate_grad_hook(after)
    except (RuntimeError, AttributeError, IndexError):  # not a leaf, an inference tensor: left to autograd
        keep.append(None)
        return
    finally:
        if frozen:
            param.requires_grad_(False)
    keep.append(node)
    acc.holders.add(holder)


def by_backward(record: Any, grad: torch.Tensor | None) -> bool | None:
    """Whether a backward wrote ``grad`` as it is now (the hooks' sum went into it and nothing changed it
    since); ``None`` when the parameter has no live hooks to tell (``accumulate_fp32=False``)."""
    acc = record.acc
    if acc is None or not len(acc.holders):
        return None
    return acc.ours(grad)


def sum_for(record: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
    """The FP32 sum behind the model gradient ``grad``, taken out of ``record`` (``None`` when
    nothing was accumulated, or something else wrote the gradient since)."""
    acc = record.acc
    if acc is None or acc.value is None:
        return None
    value = acc.value if acc.ours(grad) else None
    acc.clear()
    if value is not None and grad is not None and grad.dtype is torch.float16:
        # a sum beyond FP16's range is an overflow, as the model's gradient shows it (inf): the
        # scaler backs off and the step is skipped, whatever reads the gradient
        value = torch.where(torch.isinf(grad), grad.to(torch.float32), value)
    return value


def detach_sum(record: Any) -> None:
    """Forget the window's sum (``zero_grad``, the end of a step)."""
    if record.acc is not None:
        record.acc.clear()
