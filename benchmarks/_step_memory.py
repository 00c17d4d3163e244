"""The peak tensor memory of one optimizer step, for ``bench_step.py --memory``.

What a step allocates beyond what it holds before: on a GPU ``torch.cuda.max_memory_allocated`` over
``torch.cuda.memory_allocated`` at the start; on the CPU the same count from ``torch.profiler``'s memory
events (every allocation and free of a tensor, in order), so the number does not depend on what glibc keeps
or returns (the resident set would).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["step_peak_bytes"]


def step_peak_bytes(step: Callable[[], None], device: str) -> int:
    """The most bytes of tensors ``step`` holds at once beyond those live when it starts."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
