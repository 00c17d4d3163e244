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
import sys
import time
from pathlib import Path

import torch

try:
    import amp_plugin.emulation  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this script's helpers

from _emulation_timing import calibrate, run_rounds, table, timed
from _emulation_training import MasterWeightOptimizer, bench_training

from amp_plugin.emulation import (
    CpuHalfEmulation,
    cpu_features,
    cpu_half_path,
    native_kernels_available,
    python_kernels_only,
)

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
