"""Optimizer-step path: unscale + step + scale update, ours against the alternatives.

    python benchmarks/bench_step.py [--params 16] [--repeats 15] [--mix]

Same process, the paths alternating, median of the repeats (wall time, and the process's
CPU time, which the other jobs on a shared machine disturb less):

- floor:     fused AdamW on N FP32 params (no scaling, no casts): what any FP32 run pays.
- ours:      DynamicLossScaler + MasterWeightOptimizer(AdamW(fused=True)) over N FP16 params:
             unscale_ (the inf check), step, update. On the CPU this runs amp_plugin's fused
             kernels: a read-only inf check over the FP16 grads, then one Adam pass that reads
             the FP16 grad times 1/scale, updates master and moments and writes the FP16 weight.
             Built as the plugin builds it (``unscaled_model_grads=False``); with ``True`` (torch's
             AMP recipe) ``unscale_`` also writes FP32 master grads and shows them in the model.
- ours, torch multi-tensor (fused="torch"): the CUDA path on CPU tensors: multi-tensor copy
             and unscale into transient FP32 grads, torch's fused AdamW, multi-tensor copy back.
- ours, stock torch ops (fused=False): the same copy and unscale, then AdamW's own step().
- ours, AdamW(foreach=True): what another optimizer gets: the inf check and the FP32 copies
             from amp_plugin's kernels, then the optimizer's own step(), then a copy back.
- ours bf16_split / bf16_lean / bf16_sr: the same step over N BF16 params with the lean master
             kinds (``master="bf16_split"``: BF16 weight + 16-bit remainder; ``bf16_lean`` adds BF16
             moments; ``bf16_sr``: no master, stochastic rounding, BF16 moments), amp_plugin's
             kernel (and ``bf16_lean`` on torch's multi-tensor path; both on it with their bit handling
             compiled by torch.compile, ``fused="compiled"``: compiled during the warm-up, not timed;
             off the CPU also with it in two Triton kernels per group, ``fused="triton"``, what
             ``fused=None`` runs there). The BF16 presets run without a loss scaler by default:
             ``bf16_lean`` and ``bf16_sr`` also as the step alone (no inf check over the grads), on
             amp_plugin's kernel, compiled, and off the CPU with Triton.
- lightning: Lightning `16-mixed`'s path: torch.amp.GradScaler + default AdamW (foreach) on
             N FP32 params: unscale_, step, update.

Paths that make FP32 gradients each step allocate them anew: on the CPU, glibc returns big freed
blocks to the kernel, so each step faults their pages in again (as for AdamW(foreach=True)'s own
temporaries); ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set high keep them instead.

``--mix``: the parameters as a transformer holds them (per block: attention and MLP
matrices, their biases, two norms), not ``--chunks`` equal tensors.

Also prints the memory-traffic floor: bytes a step must move divided by the measured copy
bandwidth of this machine.

``--stages`` adds where our path's time goes: each stage of it timed on its own (wall and
process CPU time, stages alternating, median), against the floor, plus two stock-op
alternatives (the inf check reading the FP16 grads; fused AdamW doing the unscale through
its ``grad_scale``/``found_inf`` arguments), and amp_plugin's kernels (the two passes of
``ours``, and the base design's two: a copy-and-unscale into FP32 grads, then Adam reading
those); then ``bf16_lean``'s compiled step (``fused="compiled"``) as the optimizer runs it under
``torch.profiler``, its operators' time gathered into its five stages (the gradients' upcast and
unscale, the compiled join, torch's fused AdamW, the compiled stores).
``--memory`` adds each path's peak tensor memory in one step, beyond what it holds before
(``_step_memory.py``: ``torch.profiler``'s memory events on the CPU, ``max_memory_allocated`` on a GPU):
the FP32 copies a step makes, which the lean kinds' passes make one slab at a time.
``--compiled-prototype`` adds a prototype of the whole path fused by
``torch.compile`` (not what ``MasterWeightOptimizer`` does).

The rows "late in training" time the presets' step with its step counters at 20,000, as a long run
takes it: the bias correction's square root is 1.0f there, and amp_plugin's CPU kernels leave out the
division by it (torch's kernels, the floor's among them, divide at every step).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _step_memory import step_peak_bytes
from _step_stages import stage_breakdown

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import FrozenMomentWarning

LATE_STEP = 20_000


def tensor_sizes(numel: int, chunks: int, mix: bool = False) -> list[int]:
    """``chunks`` equal sizes, or (``mix``) a transformer's: per block of width ``d``, the
    QKV matrix and bias, the output projection and bias, two MLP matrices and biases, two
    norms (weight and bias each), blocks of ``d = 1024`` until ``numel`` is reached."""
    if not mix:
        return [numel // chunks] * chunks
    d = 1024
    block = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    sizes: list[int] = []
    while sum(sizes) + sum(block) <= numel:
        sizes += block
    return sizes or block


def make_params(sizes: list[int], dtype: torch.dtype, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(device, dtype))
        p.grad = (torch.randn(n, generator=g) * 1e-3).to(device, dtype)
        params.append(p)
    return params


def cpu_model() -> str:
    """The CPU's model name (lscpu), for the report."""
    import platform
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=16, help="millions of parameters")
    parser.add_argument("--chunks", type=int, default=16, help="number of parameter tensors")
    parser.add_argument("--mix", action="store_true", help="a transformer's mix of tensor sizes instead of --chunks")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to time the same paths on a GPU")
    parser.add_argument("--stages", action="store_true", help="also time each stage of our path (CPU only)")
    parser.add_argument("--memory", action="store_true", help="also the peak tensor memory of one step per path")
    parser.add_argument(
        "--compiled-prototype",
        action="store_true",
        help="with --stages: also time a torch.compile'd fused update (needs a C++ compiler)",
    )
    args = parser.parse_args()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch.cuda.is_available() is False here; use --device cpu")
    if args.stages and device != "cpu":
        parser.error(f"--stages times CPU time per stage; it needs --device cpu, not {device!r}")
    torch.set_num_threads(args.threads)
    sizes = tensor_sizes(int(args.params * 1e6), args.chunks, args.mix)
    numel = sum(sizes)

    floor_params = make_params(sizes, torch.float32, device)
    floor_opt = torch.optim.AdamW(floor_params, lr=1e-3, fused=True)

    def master_weight_path(
        fused,
        adamw_fused=True,
        master="fp32",
        moments=None,
        rounding="stochastic",
        shown=False,
        scaled=True,
        late=False,
    ):
        params = make_params(sizes, torch.float16 if master == "fp32" else torch.bfloat16, device)
        for p in params:
            p.grad.mul_(2.0**10)  # grads as a scaled backward leaves them
        inner = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if adamw_fused else {"foreach": True}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FrozenMomentWarning)  # "nearest" is timed for comparison
            opt = MasterWeightOptimizer(
                inner,
                fused=fused,
                master=master,
                moments_dtype=moments,
                moments_rounding=rounding,
                unscaled_model_grads=shown,  # False: as MixedPrecisionPlugin builds it
            )
        if late:  # the first call (the warm-up) makes the state; then it is a long run's
            assert not scaled

            def late_step() -> None:
                fresh = not opt.state
                opt.step()
                for state in opt.state.values() if fresh else ():
                    state["step"].fill_(LATE_STEP)

            return late_step
        if not scaled:  # no loss scaler: no inf check, the step alone
            return opt.step
        scaler = DynamicLossScaler(init_scale=2.0**10)

        def step() -> None:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

        return step

    light_params = make_params(sizes, torch.float32, device)
    light_opt = torch.optim.AdamW(light_params, lr=1e-3)
    scaler_device = "cuda" if device.startswith("cuda") else "cpu"
    light_scaler = torch.amp.GradScaler(scaler_device, init_scale=1.0)  # scale 1: grads stay the same each repeat
    light_scaler.scale(torch.ones((), device=device))

    def floor() -> None:
        floor_opt.step()

    def lightning() -> None:
        light_scaler.unscale_(light_opt)
        light_scaler.step(light_opt)
        light_scaler.update()

    paths = {
        "floor (fused AdamW, FP32)": floor,
        "ours (FP16 + FP32 masters)": master_weight_path(None),
        "ours, unscaled grads shown in the model (torch's AMP recipe)": master_weight_path(None, shown=True),
        'ours, torch multi-tensor (fused="torch")': master_weight_path("torch"),
        "ours, stock torch ops (fused=False)": master_weight_path(False),
        "ours, AdamW(foreach=True) (its own step)": master_weight_path(None, adamw_fused=False),
        "ours bf16_split (BF16 + remainder, 14 B/param)": master_weight_path(None, master="bf16_split"),
        "ours bf16_lean (+ BF16 moments, 10 B/param)": master_weight_path(
            None, master="bf16_split", moments=torch.bfloat16
        ),
        "ours bf16_lean, moments rounded to nearest (before)": master_weight_path(
            None, master="bf16_split", moments=torch.bfloat16, rounding="nearest"
        ),
        "ours bf16_sr (stochastic, BF16 moments, 8 B/param)": master_weight_path(
            None, master="stochastic", moments=torch.bfloat16
        ),
        "ours bf16_lean, no loss scaler (the preset's default)": master_weight_path(
            None, master="bf16_split", moments=torch.bfloat16, scaled=False
        ),
        "ours bf16_sr, no loss scaler (the preset's default)": master_weight_path(
            None, master="stochastic", moments=torch.bfloat16, scaled=False
        ),
        f"ours bf16_lean, no loss scaler, late in training (step {LATE_STEP:,})": master_weight_path(
            None, master="bf16_split", moments=torch.bfloat16, scaled=False, late=True
        ),
        f"ours bf16_sr, no loss scaler, late in training (step {LATE_STEP:,})": master_weight_path(
            None, master="stochastic", moments=torch.bfloat16, scaled=False, late=True
        ),
        'ours bf16_lean, torch multi-tensor (fused="torch")': master_weight_path(
            "torch", master="bf16_split", moments=torch.bfloat16
        ),
        'ours bf16_lean, compiled (fused="compiled")': master_weight_path(
            "compiled", master="bf16_split", moments=torch.bfloat16
        ),
        'ours bf16_sr, compiled (fused="compiled")': master_weight_path(
            "compiled", master="stochastic", moments=torch.bfloat16
        ),
        "ours bf16_lean, compiled, no loss scaler (the preset's default)": master_weight_path(
            "compiled", master="bf16_split", moments=torch.bfloat16, scaled=False
        ),
        "ours bf16_sr, compiled, no loss scaler (the preset's default)": master_weight_path(
            "compiled", master="stochastic", moments=torch.bfloat16, scaled=False
        ),
        "Lightning 16-mixed path": lightning,
    }
    if device != "cpu":  # on the CPU Triton's interpreter runs them: numerics only, far too slow to time
        paths['ours bf16_lean, Triton (fused="triton")'] = master_weight_path(
            "triton", master="bf16_split", moments=torch.bfloat16
        )
        paths['ours bf16_sr, Triton (fused="triton")'] = master_weight_path(
            "triton", master="stochastic", moments=torch.bfloat16
        )
        for preset, master in (("bf16_lean", "bf16_split"), ("bf16_sr", "stochastic")):  # what the presets run there
            paths[f"ours {preset}, Triton, no loss scaler (the preset's default)"] = master_weight_path(
                "triton", master=master, moments=torch.bfloat16, scaled=False
            )
    for fn in paths.values():  # warm up: allocate state
        fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu_times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            c0 = time.process_time()
            times[name] += timed(fn, 1, device)
            cpu_times[name].append(time.process_time() - c0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu_times.items()}
    base = medians["floor (fused AdamW, FP32)"]
    cpu_base = cpu_medians["floor (fused AdamW, FP32)"]

    # Bytes the fused FP32 AdamW step must move: read param, grad, m, v; write param, m, v.
    floor_bytes = 7 * 4 * numel
    # Ours, ideally: an inf check reading the half grad (2), then one pass that reads the half
    # grad (2), master, m, v (4 each) and writes master, m, v (4 each) and the half weight (2).
    ideal_ours_bytes = (2 + 2 + 4 * 3 + 4 * 3 + 2) * numel
    # bf16_lean: the inf check (2), then grad, weight, remainder, BF16 moments read and written (2 each).
    ideal_lean_bytes = (2 + 2 + 2 * 4 + 2 * 4) * numel
    bw = copy_bandwidth(numel, device)

    where = f"{torch.get_num_threads()} threads" if device == "cpu" else torch.cuda.get_device_name(device)
    layout = f"a transformer's mix of {len(sizes)} tensors" if args.mix else f"{len(sizes)} tensors"
    print(f"# Optimizer-step path, {numel / 1e6:.1f}M params in {layout}, {where}, median of {args.repeats}")
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; capability {torch.backends.cpu.get_cpu_capability()}")
    print(
        f"command: python benchmarks/bench_step.py --params {args.params:g} --chunks {args.chunks} "
        f"--repeats {args.repeats} --threads {args.threads}{'' if device == 'cpu' else ' --device ' + device}"
        f"{' --mix' if args.mix else ''}{' --stages' if args.stages else ''}"
        f"{' --memory' if args.memory else ''}"
        f"{' --compiled-prototype' if args.compiled_prototype else ''}\n"
    )
    print("| path | ms/step | vs floor | CPU ms/step | CPU vs floor |")
    print("|---|---:|---:|---:|---:|")
    ms = ".1f" if device == "cpu" else ".3f"  # a GPU step: a fraction of a millisecond
    for name, t in medians.items():
        c = cpu_medians[name]
        print(f"| {name} | {t * 1e3:{ms}} | {t / base:.2f}x | {c * 1e3:{ms}} | {c / cpu_base:.2f}x |")
    print(
        f"| memory-traffic floor, FP32 AdamW ({floor_bytes / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s) "
        f"| {floor_bytes / bw * 1e3:{ms}} | {floor_bytes / bw / base:.2f}x | | |"
    )
    print(
        f"| memory-traffic floor, ours ({ideal_ours_bytes / 1e6:.0f} MB) "
        f"| {ideal_ours_bytes / bw * 1e3:{ms}} | {ideal_ours_bytes / bw / base:.2f}x | | |"
    )
    print(
        f"| memory-traffic floor, ours bf16_lean ({ideal_lean_bytes / 1e6:.0f} MB) "
        f"| {ideal_lean_bytes / bw * 1e3:{ms}} | {ideal_lean_bytes / bw / base:.2f}x | | |"
    )
    ratio = medians["ours (FP16 + FP32 masters)"] / medians["Lightning 16-mixed path"]
    print(f"\nours / Lightning 16-mixed path: {ratio:.2f}x")
    if args.memory:
        print("\n# Peak tensor memory of one step beyond what the path holds before it (benchmarks/_step_memory.py)\n")
        print("| path | MB | bytes/param |")
        print("|---|---:|---:|")
        for name, fn in paths.items():
            peak = step_peak_bytes(fn, device)
            print(f"| {name} | {peak / 2**20:.1f} | {peak / numel:.2f} |")
    if args.stages:
        stage_breakdown(sizes, args.repeats, args.compiled_prototype)


if __name__ == "__main__":
    main()
