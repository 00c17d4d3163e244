"""The buffers a forward pass may change, saved and put back before a retried batch.

A training forward pass moves BatchNorm's running statistics and its batch counter, and any
buffer a module of the user's updates in its ``forward``. A retry (``DynamicLossScaler(retries=N)``)
runs the batch's forward again: with the buffers put back first, the retry sees what the first
attempt saw, and leaves them where one successful attempt would have left them.

Cost, only while retries are on: one copy of the modules' buffers per iteration, taken as one
``torch.cat`` per device and dtype (and one ``torch.stack`` of the 0-d ones, BatchNorm's
counters): a kernel or two per dtype, not one per buffer. Putting them back happens only on a
retry. Buffers are small beside the parameters: a ResNet-50's are 0.2% of its weights' bytes
(docs/loss_scaling.md has the measured time).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["BufferState", "check_modules"]


def check_modules(modules: Iterable[object], where: str) -> tuple[nn.Module, ...]:
    """``modules`` as a tuple of ``nn.Module``; anything else is a ``TypeError`` naming ``where``."""
    checked: list[nn.Module] = []
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            hint = " (pass several modules as separate arguments)" if isinstance(module, (list, tuple)) else ""
            raise TypeError(
                f"{where} takes the modules whose buffers a retry puts back (torch.nn.Module); "
                f"argument {i} is {type(module).__name__}{hint}."
            )
        checked.append(module)
    return tuple(checked)


class BufferState:
    """A snapshot of every buffer of ``modules`` (their submodules included), of any dtype.

    :meth:`restore` copies the saved values back into the same tensors and puts those tensors
    back in their modules' slots, so a buffer a forward replaced (``self.count = self.count + 1``)
    is put back as well as one it changed in place (``running_mean``), and a slot that held
    ``None`` holds ``None`` again. Buffers registered after the snapshot are left as they are.
    """

    __slots__ = ("_clones", "_rows", "_runs", "_slots")

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        slots: list[tuple[nn.Module, str, Tensor | None]] = []  # a slot holding None is put back to None
        saved: set[int] = set()  # a tensor in several slots is copied once
        seen: set[int] = set()
        runs: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}  # joined end to end by one cat
        rows: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}  # 0-d buffers, joined by one stack
        others: list[Tensor] = []  # tensor subclasses, sparse and quantized tensors: one clone each
        for module in modules:
            for owner in module.modules():
                if id(owner) in seen:
                    continue
                seen.add(id(owner))
                for name, buf in owner._buffers.items():
                    slots.append((owner, name, buf))
                    if buf is None or id(buf) in saved:
                        continue
                    saved.add(id(buf))
                    if type(buf) is not Tensor or buf.layout is not torch.strided or buf.is_quantized:
                        others.append(buf)
                    else:
                        (rows if buf.dim() == 0 else runs).setdefault((buf.device, buf.dtype), []).append(buf)
        self._slots = slots
        with torch.no_grad():
            self._runs = [
                (bufs, torch.cat([b if b.dim() == 1 else b.reshape(-1) for b in bufs])) for bufs in runs.values()
            ]
            self._rows = [(bufs, torch.stack(bufs)) for bufs in rows.values()]
            self._clones = [(buf, buf.clone()) for buf in others]

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds (a sparse buffer's copy counted at its dense size)."""
        copies = [saved for _, saved in (*self._runs, *self._rows, *self._clones)]
        return sum(saved.numel() * saved.element_size() for saved in copies)

    def restore(self) -> None:
        """Put every buffer back where it was when the snapshot was taken."""
        for owner, name, buf in self._slots:
            if owner._buffers.get(name) is not buf:
                owner._buffers[name] = buf
        with torch.no_grad():
            for bufs, flat in self._runs:
                for buf, part in zip(bufs, flat.split([b.numel() for b in bufs])):
                    buf.copy_(part.view(buf.shape))
            for bufs, stacked in self._rows:
                for buf, part in zip(bufs, stacked.unbind()):
                    buf.copy_(part)
            for buf, copy in self._clones:
                buf.copy_(copy)
