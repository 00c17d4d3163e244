"""Memory probes for the end-to-end benchmark: tensor bytes held, saved for backward, peak.

These count tensors (distinct storages, ``saved_tensors_hooks``, the CPU allocator's
records), so they do not depend on glibc's caching or the OS; the resident-set rise is
reported beside them for reference.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_plugin.app.state_bytes import held_grad
from amp_plugin.lightning import pl


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _state_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the distinct storages a run keeps between steps."""
    tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    for opt in optimizers:
        for group in opt.param_groups:
            tensors += group["params"]
        for state in opt.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        # MasterWeightOptimizer keeps one FP32 gradient buffer per master across steps.
        tensors += [b for b in getattr(opt, "_grad_buffers", []) if b is not None]
    grads = [held_grad(t) for t in list(tensors)]  # the slots: a master's .grad would make one on reading
    tensors += [g for g in grads if g is not None]
    return sum(nbytes for _, nbytes in {_storage_key(t) for t in tensors})


def proc_status_mb(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe(pl.Callback):
    """Measure two training steps in the steady state (optimizer state allocated).

    Step ``rss_step``: the peak resident set during the step over the resident set at its
    start (``VmHWM`` after resetting it, Linux), with nothing else running. Step
    ``tensor_step``: state bytes, saved activations and the step's peak tensor memory.
    """

    def __init__(self, rss_step: int, tensor_step: int) -> None:
        self.rss_step, self.tensor_step = rss_step, tensor_step
        self.result: dict[str, float] = {}
        self._saved: dict[tuple[int, int], tuple[int, bool]] = {}
        self._hooks: Any = None
        self._profiler: Any = None
        self._rss_start: float | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not t.is_sparse:
            key = _storage_key(t)
            self._saved[key] = (key[1], t.dtype == torch.float32)
        return t

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.rss_step and _reset_peak_rss():
            self._rss_start = proc_status_mb("VmRSS")
        if trainer.global_step != self.tensor_step:
            return
        self.result["state_mb"] = _state_bytes(pl_module, trainer.optimizers) / 2**20
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._hooks is not None:  # only the forward's saved tensors count as activations
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._rss_start is not None:
            self.result["rss_step_mb"] = max(proc_status_mb("VmHWM") - self._rss_start, 0.0)
            self._rss_start = None
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        events = [e for e in self._profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:
            live += e.nbytes()
            peak = max(peak, live)
        self.result["activations_mb"] = sum(n for n, _ in self._saved.values()) / 2**20
        self.result["activations_fp32_mb"] = sum(n for n, fp32 in self._saved.values() if fp32) / 2**20
        self.result["step_peak_mb"] = peak / 2**20
        self._profiler = None
