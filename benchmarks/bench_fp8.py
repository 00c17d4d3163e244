"""FP8 against BF16 on the CPU: the training step of ``char_gpt``, and one linear layer's GEMMs.

    python benchmarks/bench_fp8.py [--widths 64 256] [--steps 12] [--rounds 3]

Both presets run in this process, alternating round by round (``_harness.alternate``):

- ``bf16``: the ``bf16`` preset (BF16 weights and activations, FP32 masters; on a CPU without
  native BF16 GEMMs the matmuls are emulated: FP32 GEMMs rounded once);
- ``fp8``: the ``fp8`` preset (the same, with the ``nn.Linear`` GEMMs of the transformer blocks
  in FP8 through ``torch._scaled_mm``, delayed scaling, statistics on).

Then one ``Fp8Linear`` forward+backward against the same ``nn.Linear`` in BF16 (emulated as the
plugin does) and in FP32, to say where the FP8 emulation's time goes: the casts with their
statistics, and ``torch._scaled_mm``'s CPU kernel (dequantize, FP32 GEMM). Prints median
milliseconds and the ratio fp8/bf16, with the CPU's model name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _harness import alternate, fit_steps
from bench_step import cpu_model

from amp_plugin import CpuHalfEmulation, MixedPrecisionPlugin
from amp_plugin.fp8 import Fp8Linear, Fp8Recipe
from amp_plugin.recipes import CharGPTRecipe


def step_times(width: int, steps: int, rounds: int) -> dict[str, list[float]]:
    def run(preset: str):
        def fit() -> list[float]:
            heads = max(1, width // 32)
            return fit_steps(
                lambda: CharGPTRecipe(n_embd=width, n_head=heads, max_chars=200_000),
                steps,
                plugins=[MixedPrecisionPlugin(preset)],
            )

        return fit

    return alternate({"bf16": run("bf16"), "fp8": run("fp8")}, rounds)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def layer_times(width: int, tokens: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = torch.nn.Linear(width, 4 * width)
    fp8 = Fp8Linear.from_linear(torch.nn.Linear(width, 4 * width).bfloat16(), Fp8Recipe(fallback_steps=0))
    bf16 = torch.nn.Linear(width, 4 * width).bfloat16()
    x32 = torch.randn(tokens, width, requires_grad=True)
    x16 = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    g16 = torch.randn(tokens, 4 * width, dtype=torch.bfloat16)

    def fp8_step() -> None:
        fp8(x16).backward(g16)

    def bf16_step() -> None:
        with CpuHalfEmulation(dtypes=(torch.bfloat16,)):
            bf16(x16).backward(g16)

    def fp32_step() -> None:
        base(x32).backward(g16.float())

    a8 = torch.randn(tokens, width).to(torch.float8_e4m3fn)
    b8 = torch.randn(4 * width, width).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)

    def scaled_mm_only() -> None:  # the three GEMMs of a step, without the casts
        torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(a8.t().contiguous(), a8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(b8.t().contiguous(), b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return {
        name: _median_ms(fn, repeats)
        for name, fn in [("fp32", fp32_step), ("bf16", bf16_step), ("fp8", fp8_step), ("scaled_mm", scaled_mm_only)]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {args.threads} thread(s)")
    for width in args.widths:
        times = step_times(width, args.steps, args.rounds)
        bf16, fp8 = (statistics.median(times[k]) * 1e3 for k in ("bf16", "fp8"))
        print(f"char_gpt n_embd={width}: step bf16 {bf16:.1f} ms, fp8 {fp8:.1f} ms, fp8/bf16 {fp8 / bf16:.2f}")
        layer = layer_times(width, tokens=2048, repeats=5)
        print(
            f"  Linear({width}, {4 * width}) fwd+bwd, 2048 tokens: fp32 {layer['fp32']:.1f} ms, "
            f"bf16 (emulated) {layer['bf16']:.1f} ms, fp8 {layer['fp8']:.1f} ms "
            f"(of which torch._scaled_mm's 3 GEMMs {layer['scaled_mm']:.1f} ms), fp8/bf16 "
            f"{layer['fp8'] / layer['bf16']:.2f}"
        )


if __name__ == "__main__":
    main()
