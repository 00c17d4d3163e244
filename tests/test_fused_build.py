"""How the fused kernels are built: one cache entry per sources + flags + torch + CPU variant,
a variant per CPU capability, and an AVX-512 build that compiles (this CPU may not run it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp_plugin import fused

SOURCES = [Path(fused.__file__).with_name(name) for name in ("master_step.cpp", "emulate.cpp")]


def checkout(tmp_path: Path, name: str) -> list[Path]:
    """A copy of the kernel sources, as another checkout of the project would have them."""
    root = tmp_path / name
    root.mkdir()
    for src in SOURCES:
        shutil.copy(src, root / src.name)
    return [root / src.name for src in SOURCES]


def name_of(sources: list[Path], monkeypatch, capability: str = "AVX2") -> str:
    monkeypatch.setattr(fused, "_SOURCES", sources)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    return fused._flags()[0]


def test_the_cache_entry_is_named_by_what_goes_into_the_build(tmp_path, monkeypatch):
    a, b = checkout(tmp_path, "a"), checkout(tmp_path, "b")
    same = name_of(a, monkeypatch)
    assert name_of(b, monkeypatch) == same  # identical sources elsewhere: the same entry
    assert same.startswith("amp_plugin_fused_avx2_")
    b[1].write_text(b[1].read_text() + "\n// another checkout's change\n")
    changed = name_of(b, monkeypatch)
    assert changed != same  # changed sources: their own entry, no rebuild of the other's
    assert name_of(a, monkeypatch) == same
    # the CPU variant, the flags, the torch version each give their own entry
    assert name_of(a, monkeypatch, "AVX512").startswith("amp_plugin_fused_avx512_")
    assert name_of(a, monkeypatch, "DEFAULT").startswith("amp_plugin_fused_generic_")
    texts = [p.read_bytes() for p in a]
    assert fused.build_name(texts, ["-O3"], "avx2") != fused.build_name(texts, ["-O2"], "avx2")
    assert fused.build_name(texts, ["-O3"], "avx2") == fused.build_name(texts, ["-O3"], "avx2")
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert name_of(a, monkeypatch) != same
    # parts are length-prefixed: moving bytes from one source to the other changes the name
    assert fused.build_name([b"ab", b"c"], [], "avx2") != fused.build_name([b"a", b"bc"], [], "avx2")


def test_sources_are_staged_inside_the_entry(tmp_path, monkeypatch):
    a = checkout(tmp_path, "a")
    monkeypatch.setattr(fused, "_SOURCES", a)
    entry = tmp_path / "entry"
    staged = fused._staged_sources(str(entry))
    assert [Path(p).parent for p in staged] == [entry / "src"] * 2
    assert [Path(p).read_bytes() for p in staged] == [p.read_bytes() for p in a]
    mtimes = [os.stat(p).st_mtime_ns for p in staged]
    b = checkout(tmp_path, "b")  # another checkout with the same sources: the copies stay untouched
    monkeypatch.setattr(fused, "_SOURCES", b)
    assert fused._staged_sources(str(entry)) == staged
    assert [os.stat(p).st_mtime_ns for p in staged] == mtimes


@pytest.mark.parametrize(
    "capability,expected",
    [("AVX512", "avx512"), ("AVX2", "avx2"), ("DEFAULT", "generic"), ("ZVECTOR", "generic"), ("SVE256", "generic")],
)
def test_variant_per_capability(capability, expected):
    assert fused.variant(capability) == expected


def test_this_cpu_loads_its_variant():
    capability = torch.backends.cpu.get_cpu_capability()
    name, flags = fused._flags()
    fused.kernels()
    assert fused._flags() == (name, flags)  # building or loading changes nothing the name depends on
    assert name.startswith(f"amp_plugin_fused_{fused.variant(capability)}_")
    if capability == "AVX2":  # this project's AMD EPYC: no AVX-512
        assert "-mavx2" in flags and not any(f.startswith("-mavx512") for f in flags)
    if fused.kernels() is not None:
        from torch.utils.cpp_extension import _get_build_directory

        entry = Path(_get_build_directory(name, False))
        assert sorted(p.name for p in (entry / "src").iterdir()) == ["emulate.cpp", "master_step.cpp"]


@pytest.mark.slow
@pytest.mark.parametrize("variant_name", ["avx512"])
def test_variant_compiles(tmp_path, variant_name):
    """Compile (not load: this CPU may lack the instructions) one variant's objects, and check
    that the AVX-512 build's hot loops use 512-bit registers."""
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [*fused._BASE_FLAGS, *fused._VARIANT_FLAGS[variant_name]]
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{Path(sys.base_prefix) / 'include'}"]
    objects = []
    for src in SOURCES:
        obj = tmp_path / f"{src.stem}.o"
        cmd = [
            cxx,
            "-c",
            str(src),
            "-o",
            str(obj),
            "-std=c++17",
            "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-DTORCH_EXTENSION_NAME=amp_plugin_compile_check",
            *includes,
            *flags,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        objects.append(obj)
    if variant_name == "avx512" and shutil.which("objdump"):
        disassembly = subprocess.run(["objdump", "-d", str(objects[0])], capture_output=True, text=True).stdout
        assert "zmm" in disassembly  # master_step.cpp: 512-bit conversions and Adam loop
