"""CpuHalfEmulation as a context: what it routes, nesting, threads, backends, modules."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from _emulation_helpers import BACKENDS, assert_bitwise, rnd
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from amp_plugin.emulation import EMULATED_OPS, HALF_DTYPES, CpuHalfEmulation, cpu_half_path, should_emulate

# ------------------------------------------------------------------ routing and lifetime

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class _Spy(TorchDispatchMode):
    """Records (op, tensor dtypes) of what reaches it. Matmuls are run through their
    CPU kernel with the spy still visible, so the ops issued *inside* that kernel
    (the casts of an emulating kernel) are recorded too."""

    def __init__(self):
        super().__init__()
        self.seen = []

    @classmethod
    def _should_skip_dynamo(cls):
        return False  # plain eager method: no torch._dynamo import on first use

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        if func in MATMULS:
            self.seen.append((str(func), dtypes))
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        if func is torch.ops.aten._to_copy.default:
            self.seen.append(("cast", (dtypes[0], kwargs.get("dtype"))))
        elif func is torch.ops.aten.to.dtype:  # how ``t.float()`` shows up inside a mode
            self.seen.append(("cast", (dtypes[0], args[1])))
        return func(*args, **kwargs)


def test_routes_through_fp32_kernels(dtype, backend):
    x, w, b = rnd(3, 4, dtype=dtype, seed=60), rnd(2, 4, dtype=dtype, seed=61), rnd(2, dtype=dtype, seed=62)
    f32 = torch.float32
    up, down = ("cast", (dtype, f32)), ("cast", (f32, dtype))
    with _Spy() as spy, CpuHalfEmulation(backend=backend) as emu:
        F.linear(x, w, b)
        x @ w.t()
    assert emu.emulated_calls == {"aten.addmm.default": 1, "aten.mm.default": 1}
    if backend == "mode":
        # the spy sits below the mode: it sees the mode's upcasts, FP32 matmuls, downcasts
        assert spy.seen == [
            up,
            up,
            up,
            ("aten.addmm.default", (f32, f32, f32)),
            down,
            up,
            up,
            ("aten.mm.default", (f32, f32)),
            down,
        ]
    else:
        # the spy sits above the CPU kernels: it sees the half op enter the CPU kernel,
        # which upcasts the operands, runs the FP32 kernel and rounds the result
        assert spy.seen == [
            ("aten.addmm.default", (dtype, dtype, dtype)),
            up,
            up,
            up,
            down,
            ("aten.mm.default", (dtype, dtype)),
            up,
            up,
            down,
        ]
    with _Spy() as spy:  # outside: the native half kernel, no casts
        x @ w.t()
    assert spy.seen == [("aten.mm.default", (dtype, dtype))]


def _mm_kernel():
    return repr(torch.library.get_kernel("aten::mm", "CPU"))


def test_nesting_and_exit(backend):
    a = torch.randn(3, 3, dtype=torch.float16)
    assert not CpuHalfEmulation.is_active()
    modes, kernel = len(_get_current_dispatch_mode_stack()), _mm_kernel()
    outer, inner = CpuHalfEmulation(backend=backend), CpuHalfEmulation(backend=backend)
    with outer:
        assert CpuHalfEmulation.is_active() and outer.active
        installed = (len(_get_current_dispatch_mode_stack()), _mm_kernel())
        assert installed != (modes, kernel)
        with inner:
            with outer:  # re-entering the same instance
                a @ a
            # nesting shares one interception: no extra per-op layer
            assert (len(_get_current_dispatch_mode_stack()), _mm_kernel()) == installed
            a @ a
        assert CpuHalfEmulation.is_active() and not inner.active
        a @ a
    assert not CpuHalfEmulation.is_active() and not outer.active
    # the mode is popped / the original CPU kernel is registered again
    assert (len(_get_current_dispatch_mode_stack()), _mm_kernel()) == (modes, kernel)
    assert outer.emulated_calls == {"aten.mm.default": 3}
    assert inner.emulated_calls == {"aten.mm.default": 2}
    a @ a  # native again: nothing counted
    assert outer.emulated_calls == {"aten.mm.default": 3}
    outer.reset_counts()
    assert outer.emulated_calls == {}


def test_exception_inside_exits_cleanly(backend):
    modes, kernel = len(_get_current_dispatch_mode_stack()), _mm_kernel()
    emu = CpuHalfEmulation(backend=backend)
    with pytest.raises(ValueError), emu, CpuHalfEmulation(backend=backend):
        raise ValueError("boom")
    assert not CpuHalfEmulation.is_active()
    assert (len(_get_current_dispatch_mode_stack()), _mm_kernel()) == (modes, kernel)
    with emu:  # usable again
        torch.ones(2, 2, dtype=torch.bfloat16) @ torch.ones(2, 2, dtype=torch.bfloat16)
    assert emu.emulated_calls == {"aten.mm.default": 1}


def test_disabled_is_a_no_op():
    a = torch.randn(2, 2, dtype=torch.float16)
    kernel = _mm_kernel()
    with CpuHalfEmulation(enabled=False) as emu:
        assert not CpuHalfEmulation.is_active() and _mm_kernel() == kernel
        a @ a
    assert emu.emulated_calls == {}


def test_keep_installed_makes_contexts_cheap_but_not_active():
    a = rnd(6, 6, dtype=torch.float16, seed=73)
    native, kernel = a @ a, _mm_kernel()
    with CpuHalfEmulation.keep_installed() as hold:
        installed = _mm_kernel()
        assert installed != kernel and not CpuHalfEmulation.is_active()
        assert torch.equal(a @ a, native)  # registered, but off outside a context
        with CpuHalfEmulation(backend="kernel") as emu:
            emulated = a @ a
        assert _mm_kernel() == installed  # leaving the context kept the kernels
        with CpuHalfEmulation(backend="kernel") as emu2:
            a @ a
    assert _mm_kernel() == kernel
    assert_bitwise(emulated, (a.float() @ a.float()).to(torch.float16))
    assert emu.emulated_calls == emu2.emulated_calls == {"aten.mm.default": 1}
    hold.__exit__(None, None, None)  # a second exit is harmless
    assert _mm_kernel() == kernel


def _cpu_kernel_source(op: str) -> str:
    """Where the CPU kernel the dispatcher runs for ``op`` was registered."""
    dump = torch._C._dispatch_dump(op).splitlines()
    return next(line for line in dump if line.startswith("CPU:"))


_CPP_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def test_kernel_backend_runs_the_matmuls_in_cpp(monkeypatch):
    from amp_plugin import fused
    from amp_plugin.emulation import _backends

    assert fused.kernels() is not None, fused.unavailable_reason()
    before = {op: _cpu_kernel_source(op) for op in (*_CPP_OPS, "aten::mm.out")}
    x, w, b = (
        rnd(3, 5, 8, dtype=torch.bfloat16, seed=74),
        rnd(6, 8, dtype=torch.bfloat16, seed=75),
        rnd(6, dtype=torch.bfloat16, seed=76),
    )
    q, k = rnd(2, 4, 8, dtype=torch.float16, seed=77), rnd(2, 8, 3, dtype=torch.float16, seed=78)
    x32, w32 = x.float(), w.float()
    plain32 = F.linear(x32, w32)
    with CpuHalfEmulation.keep_installed():
        assert all("emulate.cpp" in _cpu_kernel_source(op) for op in _CPP_OPS)
        assert _cpu_kernel_source("aten::mm.out") != before["aten::mm.out"]  # a Python kernel
        assert_bitwise(F.linear(x32, w32), plain32, "FP32 passes through")
        with CpuHalfEmulation(backend="kernel") as emu:
            lin, lin2, prod = F.linear(x, w, b), F.linear(x[0], w, b), x[0] @ w.t()
            att = torch.bmm(q, k)
            att2 = torch.baddbmm(att, q, k, beta=0.5, alpha=2.0)
            with CpuHalfEmulation() as inner:  # nested: counts are split between the two
                q @ k
            assert emu.emulated_calls == {
                "aten.mm.default": 1,
                "aten.addmm.default": 2,
                "aten.bmm.default": 2,
                "aten.baddbmm.default": 1,
            }
    assert inner.emulated_calls == {"aten.bmm.default": 1}
    assert {op: _cpu_kernel_source(op) for op in before} == before
    assert_bitwise(lin, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16), "linear 3d")
    assert_bitwise(lin2, F.linear(x[0].float(), w.float(), b.float()).to(torch.bfloat16), "linear 2d")
    assert_bitwise(prod, (x[0].float() @ w.float().t()).to(torch.bfloat16), "mm")
    assert_bitwise(att, torch.bmm(q.float(), k.float()).half(), "bmm")
    assert_bitwise(att2, torch.baddbmm(att.float(), q.float(), k.float(), beta=0.5, alpha=2.0).half(), "baddbmm")

    monkeypatch.setattr(_backends, "USE_NATIVE_KERNELS", False)
    with CpuHalfEmulation(backend="kernel"):
        assert not any("emulate.cpp" in _cpu_kernel_source(op) for op in _CPP_OPS)


def test_backends_agree():
    x = rnd(2, 3, 4, dtype=torch.float16, seed=70)
    w = rnd(5, 4, dtype=torch.float16, seed=71)
    results = []
    for backend in BACKENDS:
        with CpuHalfEmulation(backend=backend):
            results.append(F.linear(x, w).float().softmax(-1))
    assert torch.equal(*results)
    with pytest.raises(ValueError, match="backend"):
        CpuHalfEmulation(backend="cuda")
    assert CpuHalfEmulation().backend in BACKENDS


def test_other_threads_unaffected(backend):
    a = rnd(8, 8, dtype=torch.float16, seed=72)
    native = a @ a
    seen = {}

    def worker():
        seen["active"] = CpuHalfEmulation.is_active()
        seen["result"] = a @ a

    with CpuHalfEmulation(backend=backend) as emu:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        a @ a
    assert seen["active"] is False
    assert torch.equal(seen["result"], native)
    assert emu.emulated_calls == {"aten.mm.default": 1}


# ------------------------------------------------------------------ one dtype emulated, the other native


def _other(dtype):
    return torch.bfloat16 if dtype is torch.float16 else torch.float16


def test_one_dtype_emulated_the_other_native(dtype, backend):
    """``dtypes=``: only that dtype is emulated; ops in the other half dtype reach the native
    kernel untouched (no casts around them), in the Python and in the C++ kernels alike."""
    other = _other(dtype)
    x, w = rnd(3, 4, dtype=dtype, seed=80), rnd(2, 4, dtype=dtype, seed=81)
    xo, wo = x.to(other), w.to(other)
    f32 = torch.float32
    with _Spy() as spy, CpuHalfEmulation(backend=backend, dtypes=dtype) as emu:
        assert emu.dtypes == {dtype}
        emulated = F.linear(x, w, x[0, :2])
        native = xo @ wo.t()
    assert emu.emulated_calls == {"aten.addmm.default": 1}
    assert_bitwise(emulated, F.linear(x.float(), w.float(), x[0, :2].float()).to(dtype), "emulated dtype")
    # the other dtype's mm went to the native kernel with no upcast
    assert ("cast", (other, f32)) not in spy.seen and ("cast", (f32, other)) not in spy.seen
    assert ("aten.mm.default", (other, other)) in spy.seen
    assert native.dtype is other


def test_nested_contexts_add_their_dtypes(backend):
    a16, ab = rnd(4, 4, dtype=torch.float16, seed=82), rnd(4, 4, dtype=torch.bfloat16, seed=83)
    outer = CpuHalfEmulation(backend=backend, dtypes="fp16")
    inner = CpuHalfEmulation(backend=backend, dtypes=["bf16"])
    with outer:
        ab @ ab  # native
        with inner:
            a16 @ a16, ab @ ab  # both emulated
        ab @ ab  # native again
        a16 @ a16
    assert outer.emulated_calls == {"aten.mm.default": 3}
    assert inner.emulated_calls == {"aten.mm.default": 2}
    assert not CpuHalfEmulation.is_active()
    with CpuHalfEmulation(backend=backend, dtypes=[]) as nothing:  # an empty set: a context that emulates nothing
        a16 @ a16
    assert nothing.emulated_calls == {}


def test_dtypes_argument():
    assert CpuHalfEmulation().dtypes == HALF_DTYPES
    assert CpuHalfEmulation(dtypes=[torch.bfloat16, "fp16"]).dtypes == HALF_DTYPES
    assert CpuHalfEmulation(dtypes="bf16-true").dtypes == {torch.bfloat16}
    auto = {dt for dt in HALF_DTYPES if not cpu_half_path(dt).native}
    assert CpuHalfEmulation(dtypes="auto").dtypes == auto
    with pytest.raises(
        ValueError, match=r"dtypes=torch.float32 is not allowed: expected torch.float16 or torch.bfloat16"
    ):
        CpuHalfEmulation(dtypes=[torch.float16, torch.float32])
    with pytest.raises(ValueError, match=r"dtypes='int8' is not allowed"):
        CpuHalfEmulation(dtypes="int8")
    with pytest.raises(TypeError, match=r"dtypes=3 is not allowed"):
        CpuHalfEmulation(dtypes=3)
    assert "dtypes=['bfloat16']" in repr(CpuHalfEmulation(dtypes="bf16"))


def test_cpp_kernels_follow_the_dtypes(monkeypatch):
    """The C++ kernels of mm/addmm/bmm/baddbmm get the thread's dtype mask."""
    from amp_plugin import fused

    ops = fused.kernels()
    if ops is None:
        pytest.skip(f"the fused kernels are not built here: {fused.unavailable_reason()}")
    a16, ab = rnd(3, 3, dtype=torch.float16, seed=84), rnd(3, 3, dtype=torch.bfloat16, seed=85)
    with CpuHalfEmulation(backend="kernel", dtypes=torch.bfloat16) as emu:
        assert ops.emulation_sync(None)[:4] == [0, 0, 0, 0]
        a16 @ a16
        assert ops.emulation_sync(None)[:4] == [0, 0, 0, 0]  # FP16: native, nothing counted
        ab @ ab
        assert ops.emulation_sync(None)[:4] == [1, 0, 0, 0]
        with CpuHalfEmulation(backend="kernel", dtypes=torch.float16) as inner:
            a16 @ a16
        a16 @ a16  # FP16 native again
        assert ops.emulation_sync(None)[:4] == [0, 0, 0, 0]
    assert inner.emulated_calls == {"aten.mm.default": 1}
    assert emu.emulated_calls == {"aten.mm.default": 1}  # the nested call; the BF16 one was taken out above


# ------------------------------------------------------------------ autocast and modules


def test_under_autocast(dtype, backend):
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    g = torch.randn(5, 3)
    with CpuHalfEmulation(backend=backend) as emu, torch.autocast("cpu", dtype=dtype):
        out = lin(x)
        assert out.dtype == dtype
    out.float().backward(g)
    # backward ran outside the context: only the forward was emulated
    assert emu.emulated_calls == {"aten.addmm.default": 1}
    xh, wh, bh = x.to(dtype), lin.weight.detach().to(dtype), lin.bias.detach().to(dtype)
    assert_bitwise(out, F.linear(xh.float(), wh.float(), bh.float()).to(dtype), "forward")

    lin.zero_grad()
    with CpuHalfEmulation(backend=backend) as emu, torch.autocast("cpu", dtype=dtype):
        out = lin(x)
        out.float().backward(g)
    assert emu.emulated_calls == {"aten.addmm.default": 1, "aten.mm.default": 1}
    gh = g.to(dtype)
    assert_bitwise(lin.weight.grad, (gh.float().t() @ xh.float()).to(dtype).float(), "grad_w")


def test_transformer_fast_path_is_emulated(backend):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc32 = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    enc16 = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).half().eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        ref = enc32(x)
        with CpuHalfEmulation(backend=backend) as emu:
            out = enc16(x.half())
    calls = emu.emulated_calls
    # the fused kernel's inner matmuls (QKV, out projection, both FFN linears, two bmm)
    inner = sum(
        calls.get(f"aten.{op}", 0)
        for op in ("addmm.default", "mm.default", "_addmm_activation.default", "bmm.default", "bmm.out")
    )
    assert inner >= 4, calls
    assert torch.allclose(out.float(), ref, atol=5e-2)


def test_training_step_small_model(dtype, backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(32, 2)
    ).to(dtype)
    x, y = torch.randn(4, 3, 8).to(dtype), torch.tensor([0, 1, 1, 0])
    with CpuHalfEmulation(backend=backend) as emu:
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == dtype for p in model.parameters())
    assert emu.emulated_calls == {
        "aten.convolution.default": 1,
        "aten.convolution_backward.default": 1,
        "aten.addmm.default": 1,
        "aten.mm.default": 2,
    }


# ------------------------------------------------------------------ helpers


@pytest.mark.parametrize(
    "device,dt,expected",
    [
        ("cpu", torch.float16, "path"),  # "path": emulated unless cpu_half_path picks the native kernels
        ("cpu", torch.bfloat16, "path"),
        (torch.device("cpu"), "fp16", "path"),
        ("cpu", "bf16-mixed", "path"),
        ("cpu", torch.float32, False),
        ("cpu", "fp32", False),
        ("cuda", torch.float16, False),
        ("cuda:0", "bf16", False),
        ("meta", torch.float16, False),
        (0, torch.float16, False),
    ],
)
def test_should_emulate(device, dt, expected):
    if expected == "path":
        expected = not cpu_half_path(dt).native
    assert should_emulate(device, dt) is expected


def test_should_emulate_rejects_unknown_precision():
    with pytest.raises(ValueError, match="fp8"):
        should_emulate("cpu", "fp8")


def test_exported_names():
    assert {torch.float16, torch.bfloat16} == HALF_DTYPES
    for name in (
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.convolution.default",
        "aten.convolution_backward.default",
    ):
        assert name in EMULATED_OPS


@pytest.mark.parametrize("enabled", ["no", 0, None])
def test_enabled_must_be_a_bool_as_the_scalers_say(enabled):
    """``CpuHalfEmulation(enabled="no")`` turned emulation on (``bool("no")``); refused, as the scalers refuse
    the same argument."""
    with pytest.raises(TypeError, match=rf"^enabled={enabled!r} is not allowed: enabled must be True or False"):
        CpuHalfEmulation(enabled=enabled)
