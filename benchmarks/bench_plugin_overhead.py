"""Our plugin's per-step overhead against Lightning's own plugin in the matching mode.

    python benchmarks/bench_plugin_overhead.py [--steps 25] [--rounds 3]

Same process, configurations alternating round by round, median step time of a small
char_gpt transformer:

- Lightning ``bf16-mixed``  vs ours ``MixedPrecisionPlugin("bf16", master_weights=False,
  autocast=True, emulate="off")`` (autocast over FP32 params, native kernels: like for like);
- Lightning ``32-true``     vs ours ``MixedPrecisionPlugin("fp32")``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import alternate, fit_steps, median_ms

from amp_plugin import MixedPrecisionPlugin
from amp_plugin.recipes.char_gpt import CharGPTRecipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args()
    module = partial(
        CharGPTRecipe,
        n_layer=2,
        n_head=4,
        n_embd=args.n_embd,
        block_size=64,
        batch_size=16,
        max_chars=200_000,
        warmup_steps=0,
    )
    run = partial(fit_steps, module, args.steps)
    configs = {
        "Lightning bf16-mixed": partial(run, precision="bf16-mixed"),
        "ours bf16 autocast (emulate=off)": partial(
            run, plugins=[MixedPrecisionPlugin("bf16", master_weights=False, autocast=True, emulate="off")]
        ),
        "Lightning 32-true": partial(run, precision="32-true"),
        "ours fp32": partial(run, plugins=[MixedPrecisionPlugin("fp32")]),
    }
    times = alternate(configs, args.rounds)
    ms = {name: median_ms(t, skip=0) for name, t in times.items()}
    print(
        f"# Plugin overhead, char_gpt (2 layers, width {args.n_embd}, block 64, batch 16), "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps, median"
    )
    print(
        f"command: python benchmarks/bench_plugin_overhead.py --steps {args.steps} --rounds {args.rounds} "
        f"--n-embd {args.n_embd}\n"
    )
    print("| mode | Lightning ms/step | ours ms/step | ours / Lightning |")
    print("|---|---:|---:|---:|")
    for label, theirs, ours in (
        ("bf16 autocast", "Lightning bf16-mixed", "ours bf16 autocast (emulate=off)"),
        ("fp32", "Lightning 32-true", "ours fp32"),
    ):
        print(f"| {label} | {ms[theirs]:.1f} | {ms[ours]:.1f} | {ms[ours] / ms[theirs]:.3f} |")


if __name__ == "__main__":
    main()
