"""Measurement (b) of ``bench_emulation.py``: one training step of a small transformer
(``nn.TransformerEncoder`` + linear head) in FP32, and in FP16/BF16 with FP32 master weights
(``MasterWeightOptimizer`` over AdamW), emulated (per backend) and native."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from _emulation_timing import run_rounds

from amp_plugin.emulation import CpuHalfEmulation, native_kernels_available, python_kernels_only

try:
    from amp_plugin.master_weights import MasterWeightOptimizer
except ImportError:  # the numerics core without master weights: plain optimizer on half params
    MasterWeightOptimizer = None

__all__ = ["MasterWeightOptimizer", "bench_training", "make_model", "make_step"]


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
