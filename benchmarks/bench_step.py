"""Optimizer-step path: unscale + step + scale update, ours against the alternatives.

    python benchmarks/bench_step.py [--params 16] [--repeats 15]

Same process, the three paths alternating, median of the repeats:

- floor:     fused AdamW on N FP32 params (no scaling, no casts): what any FP32 run pays.
- ours:      DynamicLossScaler + MasterWeightOptimizer(AdamW(fused=True)) over N FP16 params:
             unscale half grads into FP32 master grads with the inf check, step, update,
             copy masters back into the FP16 model. On the CPU this runs amp_plugin's fused
             kernels (two passes); "ours, stock torch ops" is the same with fused=False
             (four passes of stock torch kernels).
- lightning: Lightning `16-mixed`'s path: torch.amp.GradScaler + default AdamW (foreach) on
             N FP32 params: unscale_, step, update.

Also prints the memory-traffic floor: bytes a step must move divided by the measured copy
bandwidth of this machine.

``--stages`` adds where our path's time goes: each stage of it timed on its own (wall and
process CPU time, stages alternating, median), against the floor, plus two stock-op
alternatives (the inf check reading the FP16 grads; fused AdamW doing the unscale through
its ``grad_scale``/``found_inf`` arguments). ``--compiled-prototype`` adds a prototype of
the whole path fused by ``torch.compile`` (not what ``MasterWeightOptimizer`` does today).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin import fused as fused_kernels


def make_params(numel: int, chunks: int, dtype: torch.dtype, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(chunks):
        p = torch.nn.Parameter((torch.randn(numel // chunks, generator=g) * 0.02).to(device, dtype))
        p.grad = (torch.randn(numel // chunks, generator=g) * 1e-3).to(device, dtype)
        params.append(p)
    return params


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: str = "cpu") -> list[float]:
    """Wall time of each call; on a GPU, synchronized before and after."""
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(numel: int, device: str = "cpu") -> float:
    """Bytes per second of a large FP32 copy (read + write counted)."""
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    times = timed(lambda: dst.copy_(src), 10, device)
    return 2 * 4 * numel / statistics.median(times)


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


def stage_breakdown(numel: int, chunks: int, repeats: int, prototype: bool = False) -> None:
    """Time each stage of our step path on its own, alternating, against the fused-AdamW floor."""
    n = numel // chunks
    g = torch.Generator().manual_seed(0)
    half_w = [(torch.randn(n, generator=g) * 0.02).half() for _ in range(chunks)]
    half_g = [torch.randn(n, generator=g).half() for _ in range(chunks)]  # as a scaled backward leaves them
    masters = [w.float() for w in half_w]
    master_g = [torch.empty(n) for _ in range(chunks)]
    m, v = [torch.zeros(n) for _ in range(chunks)], [torch.zeros(n) for _ in range(chunks)]
    steps = [torch.ones(()) for _ in range(chunks)]
    fw, fg = [w.float() for w in half_w], [x.float() for x in half_g]
    fm, fv = [torch.zeros(n) for _ in range(chunks)], [torch.zeros(n) for _ in range(chunks)]
    fsteps = [torch.ones(()) for _ in range(chunks)]
    found, one, half_g_copy = torch.zeros(()), torch.ones(()), [x.clone() for x in half_g]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    # inv_scale=1 keeps the tensors identical from repeat to repeat; the kernels cost the same.
    stages = {
        "floor: fused AdamW on FP32 params": lambda: torch._fused_adamw_(fw, fg, fm, fv, [], fsteps, **hp),
        "1. copy FP16 grads -> FP32 master grads": lambda: torch._foreach_copy_(master_g, half_g),
        "2. unscale + inf check (FP32 master grads)":
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(master_g, found, one),
        "3. read the found-inf flag (host sync)": lambda: found.item(),
        "4. fused AdamW on the FP32 masters": lambda: torch._fused_adamw_(masters, master_g, m, v, [], steps, **hp),
        "5. copy FP32 masters -> FP16 weights": lambda: torch._foreach_copy_(half_w, masters),
        "alt: inf check reading the FP16 grads": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            half_g_copy, found, one),
        "alt: fused AdamW with grad_scale/found_inf": lambda: torch._fused_adamw_(
            masters, master_g, m, v, [], steps, grad_scale=one, found_inf=found, **hp),
    }
    ops = fused_kernels.kernels()
    if ops is not None:  # amp_plugin's two passes, in place of stages 1+2 and 4+5
        stages["fused A: unscale_into_ (stages 1+2 in one pass)"] = lambda: ops.unscale_into_(
            half_g, master_g, found, one)
        stages["fused B: adam_step_ (stages 4+5 in one pass)"] = lambda: ops.adam_step_(
            masters, master_g, m, v, steps, half_w, 1e-3, 0.9, 0.999, 0.01, 1e-8, True, False)
    if prototype:
        try:
            one_c, nonfinite_c = compiled_update()
            p_half, p_master = [w.clone() for w in half_w], [w.float() for w in half_w]
            p_m, p_v = [torch.zeros(n) for _ in range(chunks)], [torch.zeros(n) for _ in range(chunks)]
            p_step, inv = [0], torch.ones(())

            def fused() -> None:
                if bool(torch.stack([nonfinite_c(x) for x in half_g]).any()):  # one host sync
                    return
                p_step[0] += 1
                t = p_step[0]
                hp_t = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.01, 1 - 0.9**t, math.sqrt(1 - 0.999**t)])
                for i in range(chunks):
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
    print(f"\n# Where our path's time goes: each stage alone, {torch.get_num_threads()} threads, "
          f"median of {repeats}\n")
    print("| stage | ms | CPU ms | CPU vs floor |")
    print("|---|---:|---:|---:|")
    total = fused_total = 0.0
    for name in stages:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        if name[0].isdigit():
            total += c
        if name.startswith("fused"):
            fused_total += c
        print(f"| {name} | {w * 1e3:.1f} | {c * 1e3:.1f} | {c / floor_cpu:.2f}x |")
    print(f"| sum of stages 1-5 | | {total * 1e3:.1f} | {total / floor_cpu:.2f}x |")
    if fused_total:
        print(f"| sum of fused A + B (+ stage 3) | | {fused_total * 1e3:.1f} | {fused_total / floor_cpu:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=16, help="millions of parameters")
    parser.add_argument("--chunks", type=int, default=16, help="number of parameter tensors")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to time the same paths on a GPU")
    parser.add_argument("--stages", action="store_true", help="also time each stage of our path (CPU only)")
    parser.add_argument("--compiled-prototype", action="store_true",
                        help="with --stages: also time a torch.compile'd fused update (needs a C++ compiler)")
    args = parser.parse_args()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch.cuda.is_available() is False here; use --device cpu")
    if args.stages and device != "cpu":
        parser.error(f"--stages times CPU time per stage; it needs --device cpu, not {device!r}")
    torch.set_num_threads(args.threads)
    numel = int(args.params * 1e6) // args.chunks * args.chunks

    floor_params = make_params(numel, args.chunks, torch.float32, device)
    floor_opt = torch.optim.AdamW(floor_params, lr=1e-3, fused=True)

    half_params = make_params(numel, args.chunks, torch.float16, device)
    ours_opt = MasterWeightOptimizer(torch.optim.AdamW(half_params, lr=1e-3, fused=True))
    ours_scaler = DynamicLossScaler(init_scale=2.0**10)
    for p in half_params:
        p.grad.mul_(2.0**10)  # grads as a scaled backward leaves them
    stock_params = make_params(numel, args.chunks, torch.float16, device)
    stock_opt = MasterWeightOptimizer(torch.optim.AdamW(stock_params, lr=1e-3, fused=True), fused=False)
    stock_scaler = DynamicLossScaler(init_scale=2.0**10)
    for p in stock_params:
        p.grad.mul_(2.0**10)

    light_params = make_params(numel, args.chunks, torch.float32, device)
    light_opt = torch.optim.AdamW(light_params, lr=1e-3)
    scaler_device = "cuda" if device.startswith("cuda") else "cpu"
    light_scaler = torch.amp.GradScaler(scaler_device, init_scale=1.0)  # scale 1: grads stay the same each repeat
    light_scaler.scale(torch.ones((), device=device))

    def floor() -> None:
        floor_opt.step()

    def ours() -> None:
        ours_scaler.unscale_(ours_opt)
        ours_scaler.step(ours_opt)
        ours_scaler.update()

    def stock() -> None:
        stock_scaler.unscale_(stock_opt)
        stock_scaler.step(stock_opt)
        stock_scaler.update()

    def lightning() -> None:
        light_scaler.unscale_(light_opt)
        light_scaler.step(light_opt)
        light_scaler.update()

    paths = {"floor (fused AdamW, FP32)": floor, "ours (FP16 + FP32 masters)": ours,
             "ours, stock torch ops (fused=False)": stock, "Lightning 16-mixed path": lightning}
    for fn in paths.values():  # warm up: allocate state
        fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            times[name] += timed(fn, 1, device)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["floor (fused AdamW, FP32)"]

    # Bytes the fused FP32 AdamW step must move: read param, grad, m, v; write param, m, v.
    floor_bytes = 7 * 4 * numel
    # Ours, ideally: an inf check reading the half grad (2), then one pass that reads the half
    # grad (2), master, m, v (4 each) and writes master, m, v (4 each) and the half weight (2).
    ideal_ours_bytes = (2 + 2 + 4 * 3 + 4 * 3 + 2) * numel
    bw = copy_bandwidth(numel, device)

    where = f"{torch.get_num_threads()} threads" if device == "cpu" else torch.cuda.get_device_name(device)
    print(f"# Optimizer-step path, {numel / 1e6:.1f}M params in {args.chunks} tensors, "
          f"{where}, median of {args.repeats}")
    print(f"command: python benchmarks/bench_step.py --params {args.params:g} --chunks {args.chunks} "
          f"--repeats {args.repeats} --threads {args.threads}{'' if device == 'cpu' else ' --device ' + device}"
          f"{' --stages' if args.stages else ''}"
          f"{' --compiled-prototype' if args.compiled_prototype else ''}\n")
    print("| path | ms/step | vs floor |")
    print("|---|---:|---:|")
    for name, t in medians.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x |")
    print(f"| memory-traffic floor, FP32 AdamW ({floor_bytes / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s) "
          f"| {floor_bytes / bw * 1e3:.1f} | {floor_bytes / bw / base:.2f}x |")
    print(f"| memory-traffic floor, ours ({ideal_ours_bytes / 1e6:.0f} MB) "
          f"| {ideal_ours_bytes / bw * 1e3:.1f} | {ideal_ours_bytes / bw / base:.2f}x |")
    print(f"\nours / Lightning 16-mixed path: {medians['ours (FP16 + FP32 masters)'] / medians['Lightning 16-mixed path']:.2f}x")
    if args.stages:
        stage_breakdown(numel, args.chunks, args.repeats, args.compiled_prototype)


if __name__ == "__main__":
    main()
