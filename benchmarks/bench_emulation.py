"""CPU half-precision emulation: speed against native FP16/BF16 and FP32.

    python benchmarks/bench_emulation.py [--threads 1] [--repeats 7] [--d-model 256]

Three measurements, all in one process, variants alternating within every round
(so drifting machine load hits all of them alike), reported as the median over
rounds, in wall-clock milliseconds and in process CPU milliseconds (the steadier
of the two on a shared machine), with ratios against FP32:

(a) one 512x512 matmul: FP32, native FP16/BF16, emulated FP16/BF16;
(b) one training step (forward, backward, optimizer step) of a small transformer
    (``nn.TransformerEncoder`` + linear head): FP32 with AdamW; the model in
    FP16/BF16 with FP32 master weights (``MasterWeightOptimizer`` over AdamW),
    emulated and native;
(c) the per-op cost of the interception, for an op it does not cover (``view``)
    and for a covered one (a tiny ``mm``), and the cost of entering and leaving
    the outermost context, per backend;
(d) per dtype, the path ``emulate="auto"`` picks on this CPU (``cpu_half_path``: native
    oneDNN kernels on CPUs with avx512_bf16/AMX-BF16 for BF16, avx512_fp16/AMX-FP16 for FP16,
    emulation elsewhere) and its time against FP32 in (a) and (b), next to native against
    emulated. The CPU model and its half-precision units are printed at the top.

A short run: ``--repeats 3 --native-rounds 1`` (or ``--skip-native-training`` to leave the
slow native half training steps out altogether).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import amp_plugin.emulation  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amp_plugin.emulation import (
    CpuHalfEmulation,
    cpu_features,
    cpu_half_path,
    native_kernels_available,
    python_kernels_only,
)

try:
    from amp_plugin.master_weights import MasterWeightOptimizer
except ImportError:  # the numerics core without master weights: plain optimizer on half params
    MasterWeightOptimizer = None


def timed(fn, inner: int = 1, ctx=contextlib.nullcontext) -> tuple[float, float]:
    """(wall, cpu) seconds per call of ``fn`` averaged over ``inner`` calls made
    inside one ``ctx()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    with ctx():
        for _ in range(inner):
            fn()
    return (time.perf_counter() - w0) / inner, (time.process_time() - c0) / inner


def run_rounds(variants: dict, rounds: int, warmup: int = 1, only_first: dict | None = None) -> dict:
    """Alternate the variants round by round. ``variants``: name -> (fn, inner, ctx).
    ``only_first``: name -> number of rounds that variant takes part in (slow ones)."""
    only_first = only_first or {}
    samples: dict = {name: [] for name in variants}
    for name, (fn, _inner, ctx) in variants.items():
        for _ in range(0 if name in only_first else warmup):  # slow ones: their first round is long enough
            with ctx():
                fn()
    for r in range(rounds):
        for name, (fn, inner, ctx) in variants.items():
            if r < only_first.get(name, rounds):
                samples[name].append(timed(fn, inner, ctx))
    return {
        name: (statistics.median(s[0] for s in v) * 1e3, statistics.median(s[1] for s in v) * 1e3, len(v))
        for name, v in samples.items()
        if v  # a variant given 0 rounds (--skip-native-training) is left out
    }


def calibrate(fn, ctx, target_s: float = 0.05) -> int:
    timed(fn, 1, ctx)
    _, cpu = timed(fn, 1, ctx)
    return max(1, int(target_s / max(cpu, 1e-6)))


def table(results: dict, base: str, title: str) -> str:
    bw, bc, _ = results[base]
    lines = [
        f"### {title}",
        "",
        "| variant | wall ms | wall vs FP32 | CPU ms | CPU vs FP32 | rounds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (w, c, n) in results.items():
        lines.append(f"| {name} | {w:.2f} | {w / bw:.2f}x | {c:.2f} | {c / bc:.2f}x | {n} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- (a)


def bench_matmul(n: int, rounds: int) -> dict:
    """The emulated variants run inside one context per timed sample (as a training
    step would), so the numbers are the per-call cost, not the context's."""
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    none = contextlib.nullcontext
    cases = [("FP32", a32, b32, none)]
    for label, dt in (("FP16", torch.float16), ("BF16", torch.bfloat16)):
        a, b = a32.to(dt), b32.to(dt)
        with CpuHalfEmulation():
            assert torch.equal(a @ b, (a.float() @ b.float()).to(dt))
        cases += [(f"{label} emulated", a, b, CpuHalfEmulation), (f"{label} native", a, b, none)]
    variants = {}
    for name, a, b, ctx in cases:
        fn = functools.partial(torch.mm, a, b)
        variants[name] = (fn, calibrate(fn, ctx), ctx)
    return run_rounds(variants, rounds)


# ----------------------------------------------------------------------------- (b)


def make_model(d_model: int, layers: int, classes: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(d_model, classes))
    return model.to(dtype)


def make_step(args, dtype: torch.dtype, emulate: bool, backend: str = "auto"):
    model = make_model(args.d_model, args.layers, args.classes, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if dtype != torch.float32 and MasterWeightOptimizer is not None:
        opt = MasterWeightOptimizer(opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=g).to(dtype)
    y = torch.randint(0, args.classes, (args.batch, args.seq), generator=g)
    python_only = backend == "kernel-python"  # the kernel backend without its C++ kernels
    emu = CpuHalfEmulation(enabled=emulate, backend="kernel" if python_only else backend)

    def step():
        with python_kernels_only() if python_only else contextlib.nullcontext():
            emulated_step()

    def emulated_step():
        with emu:
            out = model(x)
            loss = F.cross_entropy(out.float().reshape(-1, args.classes), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()

    return step, emu, model


def bench_training(args) -> tuple[dict, list[str]]:
    notes = []
    variants, slow = {}, {}
    f16, bf16 = torch.float16, torch.bfloat16
    plan = [
        ("FP32", torch.float32, False, "auto"),
        ("FP16 emulated", f16, True, "auto"),
        ("BF16 emulated", bf16, True, "auto"),
        ("FP16 emulated, Python kernels", f16, True, "kernel-python"),
        ("FP16 emulated, mode backend", f16, True, "mode"),
        ("FP16 native", f16, False, "auto"),
        ("BF16 native", bf16, False, "auto"),
    ]
    if CpuHalfEmulation().backend == "mode":  # the default already is the mode backend
        plan = [entry for entry in plan if entry[3] not in ("mode", "kernel-python")]
    elif not native_kernels_available():  # the kernel backend runs its Python kernels anyway
        plan = [entry for entry in plan if entry[3] != "kernel-python"]
    for name, dt, emulate, backend in plan:
        step, emu, model = make_step(args, dt, emulate, backend)
        variants[name] = (step, 1, contextlib.nullcontext)
        if "native" in name:
            slow[name] = args.native_rounds
        if name == "FP16 emulated":
            step()
            emu.reset_counts()
            step()
            calls = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(emu.emulated_calls.items()))
            notes.append(f"emulated per training step: {calls}")
            # nn.TransformerEncoderLayer's fused fast path (eval, no grad) is covered too
            model.eval()
            probe = CpuHalfEmulation()
            with torch.no_grad(), probe:
                model(torch.randn(2, args.seq, args.d_model).to(dt))
            model.train()
            inner = sum(v for k, v in probe.emulated_calls.items())
            notes.append(
                "eval/no-grad forward (fused `_transformer_encoder_layer_fwd` fast path): "
                f"{inner} matmul-family calls emulated inside it"
            )
    results = run_rounds(variants, args.repeats, warmup=1, only_first=slow)
    return results, notes


# ----------------------------------------------------------------------------- (c)


def bench_overhead(n: int = 20000) -> dict:
    """CPU microseconds: per op (best of 3 loops) and per outermost enter + exit."""
    x = torch.randn(4)
    a16 = torch.randn(8, 8, dtype=torch.float16)
    a32 = a16.float()

    def per_call(fn, calls: int, ctx) -> float:
        return min(timed(fn, calls, ctx)[1] for _ in range(3)) * 1e6

    def enter_exit(make) -> float:
        emu = make()

        def fn():
            with emu:
                pass

        return per_call(fn, 200, contextlib.nullcontext)

    @contextlib.contextmanager
    def python_kernels_held():
        """keep_installed() with the kernel backend's Python kernels only (no C++ kernels)."""
        with python_kernels_only(), CpuHalfEmulation.keep_installed():
            yield

    rows = [("no context", contextlib.nullcontext, contextlib.nullcontext)]
    if CpuHalfEmulation().backend == "kernel":
        kind = "C++ kernels for mm" if native_kernels_available() else "Python kernels only"
        rows += [
            (f"kernel backend ({kind})", lambda: CpuHalfEmulation(backend="kernel"), contextlib.nullcontext),
            (
                f"kernel backend ({kind}), inside `keep_installed()`",
                lambda: CpuHalfEmulation(backend="kernel"),
                CpuHalfEmulation.keep_installed,
            ),
        ]
        if native_kernels_available():
            rows.append(
                (
                    "kernel backend (Python kernels only), inside `keep_installed()`",
                    lambda: CpuHalfEmulation(backend="kernel"),
                    python_kernels_held,
                )
            )
    rows.append(("mode backend", lambda: CpuHalfEmulation(backend="mode"), contextlib.nullcontext))
    out = {}
    for label, make, hold in rows:
        with hold():
            out[label] = (
                per_call(functools.partial(x.view, -1), n, make),
                per_call(functools.partial(torch.mm, a32, a32), n // 10, make),
                per_call(functools.partial(torch.mm, a16, a16), n // 10, make),
                None if label == "no context" else enter_exit(make),
            )
    return out


# ----------------------------------------------------------------------------- (d)


def cpu_line() -> str:
    f = cpu_features()
    yes = {True: "yes", False: "no"}
    return (
        f"CPU: {f.model}; torch CPU capability {f.capability}; half-precision units: {f.flags()}; "
        f"torch sends BF16 / FP16 GEMMs to oneDNN: {yes[f.onednn_bf16]} / {yes[f.onednn_fp16]}"
    )


def auto_summary(mm: dict, steps: dict, matmul_n: int) -> tuple[str, list[str]]:
    """Table (d) and the goal lines: the path auto picks per dtype, against FP32 (wall / CPU
    time ratios of the medians in (a) and (b))."""

    def ratio(results: dict, name: str, base: str) -> str:
        if name not in results or base not in results:
            return "-"
        (w, c, _), (bw, bc, _) = results[name], results[base]
        return f"{w / bw:.2f}x / {c / bc:.2f}x"

    lines = [
        '### (d) what `emulate="auto"` picks on this CPU',
        "",
        f"| dtype | auto path | {matmul_n}x{matmul_n} matmul vs FP32 (wall / CPU) | training step vs FP32 (wall / CPU) "
        "| native vs emulated: matmul | native vs emulated: step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    goals = []
    for label, dt, goal in (("FP16", torch.float16, 1.0), ("BF16", torch.bfloat16, 0.65)):
        path = cpu_half_path(dt)
        chosen = f"{label} {'native' if path.native else 'emulated'}"
        native, emulated = f"{label} native", f"{label} emulated"
        lines.append(
            f"| {label} | {path.reason} | {ratio(mm, chosen, 'FP32')} | {ratio(steps, chosen, 'FP32')} "
            f"| {ratio(mm, native, emulated)} | {ratio(steps, native, emulated)} |"
        )
        if path.native and chosen in steps:
            step = steps[chosen][0] / steps["FP32"][0]
            goals.append(
                f"{label} training step on its native path: {step:.2f}x FP32 wall time "
                f"(goal <= {goal}x on avx512_bf16 CPUs: {'met' if step <= goal else 'missed'})"
            )
        else:
            goals.append(
                f"{label} goal for CPUs with native {label} units (<= {goal}x FP32): not measurable "
                f"here, auto runs {label} {path.reason}"
            )
    return "\n".join(lines), goals


# -----------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadiest ratios)")
    p.add_argument("--repeats", type=int, default=9, help="rounds per variant (median reported)")
    p.add_argument("--native-rounds", type=int, default=2, help="rounds for the slow native half training steps")
    p.add_argument("--matmul", type=int, default=512, help="square matmul size for (a)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--classes", type=int, default=64, help="output size of the linear head")
    p.add_argument("--skip-native-training", action="store_true", help="leave out the slow native half steps")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    print("```")
    print("python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    print("```")
    print(cpu_line())
    print()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"emulation backend {CpuHalfEmulation().backend!r}, "
        f"master weights: {'MasterWeightOptimizer' if MasterWeightOptimizer else 'none (plain AdamW on half params)'}"
    )
    print()

    mm = bench_matmul(args.matmul, args.repeats)
    print(table(mm, "FP32", f"(a) {args.matmul}x{args.matmul} matmul, per call"))
    print()

    if args.skip_native_training:
        args.native_rounds = 0
    results, notes = bench_training(args)
    print(
        table(
            results,
            "FP32",
            f"(b) training step: TransformerEncoder d_model={args.d_model}, {args.layers} layers, "
            f"seq {args.seq}, batch {args.batch}, linear head to {args.classes}; AdamW",
        )
    )
    print()
    for note in notes:
        print(f"- {note}")
    emu_ratio = results["FP16 emulated"][1] / results["FP32"][1]
    goal = "met" if emu_ratio <= 1.15 else "missed"
    print(f"- FP16 emulated training step: {emu_ratio:.2f}x FP32 CPU time (goal <= 1.15x: {goal})")
    print()

    ovh = bench_overhead()
    base = ovh["no context"]
    print("### (c) cost of the interception (CPU microseconds, best of 3)")
    print()
    print(
        "| context | `view` (not covered) | 8x8 FP32 `mm` (passes through) | 8x8 FP16 `mm` (emulated) "
        "| outermost enter + exit |"
    )
    print("|---|---:|---:|---:|---:|")
    for label, (v, m32, m16, ee) in ovh.items():
        if ee is None:
            print(f"| {label} | {v:.1f} | {m32:.1f} | {m16:.1f} (native) | - |")
        else:
            print(
                f"| {label} | {v:.1f} ({v - base[0]:+.1f}) | {m32:.1f} ({m32 - base[1]:+.1f}) | {m16:.1f} | {ee:.0f} |"
            )
    print()
    table_d, goals = auto_summary(mm, results, args.matmul)
    print(table_d)
    print()
    for line in goals:
        print(f"- {line}")
    print()
    print(f"total benchmark time: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
