"""Optimizer-step path: unscale + step + scale update, ours against the alternatives.

    python benchmarks/bench_step.py [--params 16] [--repeats 15]

Same process, the three paths alternating, median of the repeats:

- floor:     fused AdamW on N FP32 params (no scaling, no casts): what any FP32 run pays.
- ours:      DynamicLossScaler + MasterWeightOptimizer(AdamW(fused=True)) over N FP16 params:
             unscale half grads into FP32 master grads with the inf check, step, update,
             copy masters back into the FP16 model.
- lightning: Lightning `16-mixed`'s path: torch.amp.GradScaler + default AdamW (foreach) on
             N FP32 params: unscale_, step, update.

Also prints the memory-traffic floor: bytes a step must move divided by the measured copy
bandwidth of this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer


def make_params(numel: int, chunks: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(chunks):
        p = torch.nn.Parameter((torch.randn(numel // chunks, generator=g) * 0.02).to(dtype))
        p.grad = (torch.randn(numel // chunks, generator=g) * 1e-3).to(dtype)
        params.append(p)
    return params


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(numel: int) -> float:
    """Bytes per second of a large FP32 copy (read + write counted)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    times = timed(lambda: dst.copy_(src), 10)
    return 2 * 4 * numel / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=16, help="millions of parameters")
    parser.add_argument("--chunks", type=int, default=16, help="number of parameter tensors")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    numel = int(args.params * 1e6) // args.chunks * args.chunks

    floor_params = make_params(numel, args.chunks, torch.float32)
    floor_opt = torch.optim.AdamW(floor_params, lr=1e-3, fused=True)

    half_params = make_params(numel, args.chunks, torch.float16)
    ours_opt = MasterWeightOptimizer(torch.optim.AdamW(half_params, lr=1e-3, fused=True))
    ours_scaler = DynamicLossScaler(init_scale=2.0**10)
    for p in half_params:
        p.grad.mul_(2.0**10)  # grads as a scaled backward leaves them

    light_params = make_params(numel, args.chunks, torch.float32)
    light_opt = torch.optim.AdamW(light_params, lr=1e-3)
    light_scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # scale 1: grads stay the same each repeat
    light_scaler.scale(torch.ones(()))

    def floor() -> None:
        floor_opt.step()

    def ours() -> None:
        ours_scaler.unscale_(ours_opt)
        ours_scaler.step(ours_opt)
        ours_scaler.update()

    def lightning() -> None:
        light_scaler.unscale_(light_opt)
        light_scaler.step(light_opt)
        light_scaler.update()

    paths = {"floor (fused AdamW, FP32)": floor, "ours (FP16 + FP32 masters)": ours, "Lightning 16-mixed path": lightning}
    for fn in paths.values():  # warm up: allocate state
        fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            times[name] += timed(fn, 1)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["floor (fused AdamW, FP32)"]

    # Bytes the fused FP32 AdamW step must move: read param, grad, m, v; write param, m, v.
    floor_bytes = 7 * 4 * numel
    # Ours, ideally: read half grad (2), master (4), m, v; write master, m, v, half weight (2).
    ideal_ours_bytes = (2 + 4 * 4 + 4 * 3 + 2) * numel
    bw = copy_bandwidth(numel)

    print(f"# Optimizer-step path, {numel / 1e6:.1f}M params in {args.chunks} tensors, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"command: python benchmarks/bench_step.py --params {args.params:g} --chunks {args.chunks} "
          f"--repeats {args.repeats}\n")
    print("| path | ms/step | vs floor |")
    print("|---|---:|---:|")
    for name, t in medians.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x |")
    print(f"| memory-traffic floor, FP32 AdamW ({floor_bytes / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s) "
          f"| {floor_bytes / bw * 1e3:.1f} | {floor_bytes / bw / base:.2f}x |")
    print(f"| memory-traffic floor, ours ({ideal_ours_bytes / 1e6:.0f} MB) "
          f"| {ideal_ours_bytes / bw * 1e3:.1f} | {ideal_ours_bytes / bw / base:.2f}x |")
    print(f"\nours / Lightning 16-mixed path: {medians['ours (FP16 + FP32 masters)'] / medians['Lightning 16-mixed path']:.2f}x")


if __name__ == "__main__":
    main()
