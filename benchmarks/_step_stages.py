"""``bench_step.py --stages``: where the optimizer step's time goes, each stage timed on its own.

Our FP16 + FP32-master path stage by stage against the fused-AdamW floor, the stock-op alternatives,
amp_plugin's two kernel passes, a ``torch.compile`` prototype of the whole path (``--compiled-prototype``),
and ``bf16_lean``'s compiled step (``fused="compiled"``) profiled as the optimizer runs it.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin import fused as fused_kernels

__all__ = ["stage_breakdown"]


def compiled_update():
    """A prototype of the fused step ``torch.compile`` can build from stock ops (AdamW only).

    Per tensor, one pass: read the FP16 grad, the FP32 master and both moments; write the
    master, the moments and the FP16 weight. Hyperparameters travel as one tensor so that
    the per-step bias corrections do not trigger recompiles. Returns the compiled per-tensor
    update and the compiled per-tensor non-finite check.
    """

    def one(half_w, half_g, master, m, v, inv_scale, hp):
        lr, b1, b2, eps, wd, bc1, bc2_sqrt = hp.unbind()
        g = half_g.float() * inv_scale
        m_new = m.lerp(g, 1 - b1)
        v_new = v * b2 + (1 - b2) * g * g
        p = master * (1 - lr * wd) - (lr / bc1) * m_new / (v_new.sqrt() / bc2_sqrt + eps)
        m.copy_(m_new)
        v.copy_(v_new)
        master.copy_(p)
        half_w.copy_(p)

    def nonfinite(half_g):
        return (~torch.isfinite(half_g)).any()

    one_c = torch.compile(one, dynamic=True, fullgraph=True)
    nonfinite_c = torch.compile(nonfinite, dynamic=True, fullgraph=True)
    return one_c, nonfinite_c


def lean_compiled_profile(sizes: list[int], repeats: int, floor_cpu: float) -> None:
    """Where ``bf16_lean``'s compiled step (``fused="compiled"``, with a dynamic scaler) spends its time:
    the step as the optimizer runs it, under ``torch.profiler``, each operator's self CPU time per step
    gathered into the step's stages (the compiled graphs before torch's fused AdamW are the joins and the
    gradients' upcast, those after it the stores), against the floor's CPU time."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).bfloat16()) for n in sizes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 2.0**10).bfloat16()
    inner = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt = MasterWeightOptimizer(
        inner, fused="compiled", master="bf16_split", moments_dtype=torch.bfloat16, unscaled_model_grads=False
    )
    scaler = DynamicLossScaler(init_scale=2.0**10)

    def step() -> None:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    for _ in range(2):  # compiles
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    adam_at = next(e.time_range.start for e in events if e.name == "aten::_fused_adamw_")
    first_seen: dict[str, float] = {}
    for e in events:
        if e.name.startswith("## Call CompiledFxGraph"):
            first_seen.setdefault(e.name, e.time_range.start)
    joins = tuple(name for name, at in first_seen.items() if at < adam_at)  # the first step's, before its Adam
    stores = tuple(name for name, at in first_seen.items() if at > adam_at)
    stages = {
        "1. upcast the BF16 grads with torch's ops (where the passes leave them)": (
            "aten::_foreach_mul",
            "aten::mul",
            "aten::_to_copy",
            "aten::copy_",
        ),
        "2. the scaler's inf check": ("aten::_amp_foreach_non_finite_check_and_unscale_",),
        "3. join weights, upcast moments and grads (compiled)": joins,
        "4. torch's fused AdamW on the FP32 values": ("aten::_fused_adamw_",),
        "5. split weights, round moments (compiled)": stores,
    }
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(self_us.values())
    print(f"\n# Where bf16_lean's compiled step goes (torch.profiler, self CPU time), {repeats} steps\n")
    print("| stage of the compiled step | CPU ms/step | CPU vs floor |")
    print("|---|---:|---:|")
    counted = 0.0
    for name, ops in stages.items():
        us = sum(self_us.get(op, 0.0) for op in ops)
        counted += us
        ms = us / repeats / 1e3
        print(f"| lean compiled {name} | {ms:.1f} | {ms / 1e3 / floor_cpu:.2f}x |")
    rest = (total - counted) / repeats / 1e3
    print(f"| lean compiled: the rest (Python, small ops, the profiler) | {rest:.1f} | {rest / 1e3 / floor_cpu:.2f}x |")
    ms = total / repeats / 1e3
    print(f"| sum of lean compiled | {ms:.1f} | {ms / 1e3 / floor_cpu:.2f}x |")


def stage_breakdown(sizes: list[int], repeats: int, prototype: bool = False) -> None:
    """Time each stage of our step path on its own, alternating, against the fused-AdamW floor."""
    g = torch.Generator().manual_seed(0)
    half_w = [(torch.randn(n, generator=g) * 0.02).half() for n in sizes]
    half_g = [torch.randn(n, generator=g).half() for n in sizes]  # as a scaled backward leaves them
    masters = [w.float() for w in half_w]
    master_g = [torch.empty(n) for n in sizes]
    m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    steps = [torch.ones(()) for _ in sizes]
    fw, fg = [w.float() for w in half_w], [x.float() for x in half_g]
    fm, fv = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    fsteps = [torch.ones(()) for _ in sizes]
    found, one, half_g_copy = torch.zeros(()), torch.ones(()), [x.clone() for x in half_g]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    # inv_scale=1 keeps the tensors identical from repeat to repeat; the kernels cost the same.
    stages = {
        "floor: fused AdamW on FP32 params": lambda: torch._fused_adamw_(fw, fg, fm, fv, [], fsteps, **hp),
        "1. copy FP16 grads -> FP32 master grads": lambda: torch._foreach_copy_(master_g, half_g),
        "2. unscale + inf check (FP32 master grads)": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            master_g, found, one
        ),
        "3. read the found-inf flag (host sync)": lambda: found.item(),
        "4. fused AdamW on the FP32 masters": lambda: torch._fused_adamw_(masters, master_g, m, v, [], steps, **hp),
        "5. copy FP32 masters -> FP16 weights": lambda: torch._foreach_copy_(half_w, masters),
        "alt: inf check reading the FP16 grads": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            half_g_copy, found, one
        ),
        "alt: fused AdamW with grad_scale/found_inf": lambda: torch._fused_adamw_(
            masters, master_g, m, v, [], steps, grad_scale=one, found_inf=found, **hp
        ),
    }
    ops = fused_kernels.kernels()
    if ops is not None:  # amp_plugin's two passes, in place of stages 1, 2, 4 and 5
        stages["fused A: nonfinite_check_ (reads the FP16 grads)"] = lambda: ops.nonfinite_check_(half_g, found)
        stages["fused B: adam_step_ (FP16 grads * 1/scale in, FP16 weights out)"] = lambda: ops.adam_step_(
            masters, half_g, m, v, steps, half_w, 1e-3, 0.9, 0.999, 0.01, 1e-8, True, False, 1.0
        )
        stages["base design A: unscale_into_ (writes FP32 grads)"] = lambda: ops.unscale_into_(
            half_g, master_g, found, one
        )
        stages["base design B: adam_step_ (FP32 grads in)"] = lambda: ops.adam_step_(
            masters, master_g, m, v, steps, half_w, 1e-3, 0.9, 0.999, 0.01, 1e-8, True, False
        )
    if prototype:
        try:
            one_c, nonfinite_c = compiled_update()
            p_half, p_master = [w.clone() for w in half_w], [w.float() for w in half_w]
            p_m, p_v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
            p_step, inv = [0], torch.ones(())

            def fused() -> None:
                if bool(torch.stack([nonfinite_c(x) for x in half_g]).any()):  # one host sync
                    return
                p_step[0] += 1
                t = p_step[0]
                hp_t = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.01, 1 - 0.9**t, math.sqrt(1 - 0.999**t)])
                for i in range(len(sizes)):
                    one_c(p_half[i], half_g[i], p_master[i], p_m[i], p_v[i], inv, hp_t)

            t0 = time.perf_counter()
            fused()
            print(f"\n(prototype compiled in {time.perf_counter() - t0:.1f} s)")
            stages["prototype: torch.compile'd check + unscale + AdamW + copy-back"] = fused
        except Exception as err:  # no C++ compiler, or an inductor limitation
            print(f"\n(prototype skipped: {type(err).__name__}: {str(err).splitlines()[0][:120]})")
    for fn in stages.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in stages}
    cpu: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(repeats):
        for name, fn in stages.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    floor_cpu = statistics.median(cpu["floor: fused AdamW on FP32 params"])
    print(f"\n# Where our path's time goes: each stage alone, {torch.get_num_threads()} threads, median of {repeats}\n")
    print("| stage | ms | CPU ms | CPU vs floor |")
    print("|---|---:|---:|---:|")
    total = fused_total = base_total = 0.0
    for name in stages:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        if name[0].isdigit():
            total += c
        if name.startswith("fused"):
            fused_total += c
        if name.startswith("base design"):
            base_total += c
        print(f"| {name} | {w * 1e3:.1f} | {c * 1e3:.1f} | {c / floor_cpu:.2f}x |")
    print(f"| sum of stages 1-5 | | {total * 1e3:.1f} | {total / floor_cpu:.2f}x |")
    if fused_total:
        print(f"| sum of fused A + B (+ stage 3) | | {fused_total * 1e3:.1f} | {fused_total / floor_cpu:.2f}x |")
        print(f"| sum of base design A + B | | {base_total * 1e3:.1f} | {base_total / floor_cpu:.2f}x |")
    try:
        lean_compiled_profile(sizes, repeats, floor_cpu)
    except Exception as err:  # no C++ compiler, or an inductor limitation
        print(f"\n(lean compiled profile skipped: {type(err).__name__}: {str(err).splitlines()[0][:120]})")
