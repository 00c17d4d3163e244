"""Two-byte Adam moments against FP32 moments: can a stored moment follow a gradient-scale drop?

    python benchmarks/bench_moments.py [--numel 4096] [--before 300] [--after 3000] [--betas2 0.999 0.9995]

Adam's ``exp_avg_sq`` ``v`` must shrink when the gradients do: by ``beta2`` per step, a relative
change of ``1 - beta2`` (0.001 at torch's default). A value rounded to nearest moves only by more
than half its ulp (``2**-9`` of it at least in BF16, ``2**-12`` in FP16), so at ``beta2 > 1 - 2**-9``
a BF16 ``v`` rounded to nearest never decreases: it becomes a running maximum, and the updates
``m / sqrt(v)`` shrink.

The regime: gradients ``N(0, 1)`` for ``--before`` steps, then ``N(0, 0.01**2)`` (100x smaller) for
``--after`` steps, one tensor of ``--numel`` elements, Adam (lr 1e-3, eps 1e-8). The schemes, all
computing the step in FP32 and differing only in how the moments are stored between steps:

- ``fp32``: the reference.
- ``bf16 nearest``: BF16, round to nearest even (what ``bf16_lean``/``bf16_sr`` stored before).
- ``bf16 stochastic``: BF16, seeded stochastic rounding (the scheme now in ``bf16_lean``/``bf16_sr``).
- ``fp16 scaled``: FP16 rounded to nearest, with a per-tensor power-of-two scale chosen each step
  so the tensor's largest value sits near FP16's top (one float per tensor besides 2 bytes).

Printed per beta2 and scheme: the stored ``v`` over FP32's (median over the elements) at the end,
the update size over FP32's (mean ``|dp|`` of the last 100 steps), and the fraction of element
steps after the drop in which the stored ``v`` decreased. Then the same regime through
``MasterWeightOptimizer(AdamW, moments_dtype=torch.bfloat16)`` (``master="bf16_split"`` and
``"stochastic"``, both roundings): the product's own path. Exact arithmetic, no timing: any
machine gives the same numbers for the same torch build.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch

from amp_plugin import MasterWeightOptimizer
from amp_plugin.master_weights import FrozenMomentWarning, SRGenerator, moments_key, round_stochastic

BF16 = torch.bfloat16


def gradients(numel: int, before: int, after: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for step in range(before + after):
        scale = 1.0 if step < before else 0.01
        yield torch.randn(numel, generator=gen) * scale


class Store:
    """How a scheme keeps ``m`` and ``v`` between steps."""

    def __init__(self, name: str, numel: int) -> None:
        self.name = name
        self.sr = SRGenerator(1234)
        self.m = torch.zeros(numel)
        self.v = torch.zeros(numel)

    def put(self, m: torch.Tensor, v: torch.Tensor) -> None:
        if self.name == "fp32":
            self.m, self.v = m.clone(), v.clone()
        elif self.name == "bf16 nearest":
            self.m, self.v = m.to(BF16).float(), v.to(BF16).float()
        elif self.name == "bf16 stochastic":
            (key,) = self.sr.keys([0])
            out_m, out_v = torch.empty(m.shape, dtype=BF16), torch.empty(v.shape, dtype=BF16)
            round_stochastic(m, out_m, moments_key(key))
            round_stochastic(v, out_v, moments_key(key), low=True)  # one hash per element for both
            self.m, self.v = out_m.float(), out_v.float()
        elif self.name == "fp16 scaled":
            self.m, self.v = _fp16_scaled(m), _fp16_scaled(v)
        else:
            raise ValueError(self.name)


def _fp16_scaled(x: torch.Tensor) -> torch.Tensor:
    amax = float(x.abs().max())
    if amax == 0 or not math.isfinite(amax):
        return x.clone()
    scale = 2.0 ** (14 - math.ceil(math.log2(amax)))  # the largest value lands in [2**13, 2**14]
    return (x * scale).to(torch.float16).float() / scale


SCHEMES = ("fp32", "bf16 nearest", "bf16 stochastic", "fp16 scaled")


def simulate(numel: int, before: int, after: int, beta2: float) -> dict[str, dict[str, float]]:
    """Each scheme through the regime; the ratios to ``fp32``."""
    lr, beta1, eps = 1e-3, 0.9, 1e-8
    stores = {name: Store(name, numel) for name in SCHEMES}
    params = {name: torch.zeros(numel) for name in SCHEMES}
    updates: dict[str, list[float]] = {name: [] for name in SCHEMES}
    decreased = dict.fromkeys(SCHEMES, 0)
    for step, g in enumerate(gradients(numel, before, after), start=1):
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        for name, store in stores.items():
            m = beta1 * store.m + (1 - beta1) * g
            v = beta2 * store.v + (1 - beta2) * g * g
            old_v = store.v
            store.put(m, v)
            update = lr * (store.m / bc1) / ((store.v / bc2).sqrt() + eps)
            params[name] -= update
            if step > before:
                decreased[name] += int((store.v < old_v).sum())
            if step > before + after - 100:
                updates[name].append(float(update.abs().mean()))
    ref_v, ref_u = stores["fp32"].v, sum(updates["fp32"])
    return {
        name: {
            "v": float((stores[name].v / ref_v).median()),
            "update": sum(updates[name]) / ref_u,
            "decreased": decreased[name] / (numel * after),
        }
        for name in SCHEMES
    }


def through_optimizer(numel: int, before: int, after: int, beta2: float) -> dict[str, dict[str, float]]:
    """The regime through ``MasterWeightOptimizer`` with BF16 moments (both kinds, both roundings) and
    with FP32 moments (``master="bf16_split"``, FP32 AdamW's bits): stored ``v`` and updates over FP32's."""
    runs: dict[str, tuple[torch.Tensor, list[float]]] = {}
    configs = {
        "fp32 moments": ("bf16_split", None, "stochastic"),
        "bf16_split, bf16 nearest": ("bf16_split", BF16, "nearest"),
        "bf16_split, bf16 stochastic": ("bf16_split", BF16, "stochastic"),
        "stochastic, bf16 nearest": ("stochastic", BF16, "nearest"),
        "stochastic, bf16 stochastic": ("stochastic", BF16, "stochastic"),
    }
    for label, (master, moments, rounding) in configs.items():
        weight = torch.nn.Parameter(torch.ones(numel, dtype=BF16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FrozenMomentWarning)
            opt = MasterWeightOptimizer(
                torch.optim.AdamW([weight], lr=1e-3, betas=(0.9, beta2), weight_decay=0.0),
                master=master,
                moments_dtype=moments,
                moments_rounding=rounding,
                sr_seed=5 if master == "stochastic" or (moments is not None and rounding == "stochastic") else None,
            )
        sizes: list[float] = []
        for step, g in enumerate(gradients(numel, before, after), start=1):
            weight.grad = g.to(BF16)
            before_step = opt.fp32_masters()[0]
            opt.step()
            if step > before + after - 100:
                sizes.append(float((opt.fp32_masters()[0] - before_step).abs().mean()))
        v = opt.state[opt.master_params()[0]]["exp_avg_sq"].float()
        runs[label] = (v, sizes)
    ref_v, ref_sizes = runs["fp32 moments"]
    return {
        label: {"v": float((v / ref_v).median()), "update": sum(sizes) / sum(ref_sizes)}
        for label, (v, sizes) in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--before", type=int, default=300)
    parser.add_argument("--after", type=int, default=3000)
    parser.add_argument("--betas2", type=float, nargs="+", default=[0.999, 0.9995])
    args = parser.parse_args()
    print(f"gradients N(0, 1) for {args.before} steps, then N(0, 0.01**2) for {args.after}; {args.numel} elements\n")
    for beta2 in args.betas2:
        print(f"beta2 = {beta2}: the schemes (stored v and update size over FP32 moments' at the end)")
        print("| scheme | v / fp32 v | update / fp32 update | element steps in which v decreased |")
        print("|---|---:|---:|---:|")
        for name, row in simulate(args.numel, args.before, args.after, beta2).items():
            print(f"| {name} | {row['v']:.3f} | {row['update']:.3f} | {row['decreased']:.3f} |")
        print(f"\nbeta2 = {beta2}: MasterWeightOptimizer(AdamW), against master='bf16_split' with FP32 moments")
        print("| master, moments | v / fp32 v | update / fp32 update |")
        print("|---|---:|---:|")
        for label, row in through_optimizer(args.numel, args.before, args.after, beta2).items():
            print(f"| {label} | {row['v']:.3f} | {row['update']:.3f} |")
        print()


if __name__ == "__main__":
    main()
