"""How the fused kernels are built: one cache entry per sources + flags + torch + CPU variant,
a variant per CPU capability, and an AVX-512 build that compiles (this CPU may not run it)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from amp_plugin import fused

SOURCES = [Path(fused.__file__).with_name(name) for name in ("master_step.cpp", "emulate.cpp")]
HEADERS = [Path(fused.__file__).with_name(name) for name in ("fused_simd.h", "adam_update.h")]


def checkout(tmp_path: Path, name: str) -> list[Path]:
    """A copy of the kernel sources and headers, as another checkout of the project would have them
    (returns the sources, then the headers)."""
    root = tmp_path / name
    root.mkdir()
    for src in (*SOURCES, *HEADERS):
        shutil.copy(src, root / src.name)
    return [root / src.name for src in (*SOURCES, *HEADERS)]


def use(files: list[Path], monkeypatch) -> None:
    monkeypatch.setattr(fused, "_SOURCES", files[: len(SOURCES)])
    monkeypatch.setattr(fused, "_HEADERS", files[len(SOURCES) :])


def name_of(files: list[Path], monkeypatch, capability: str = "AVX2") -> str:
    use(files, monkeypatch)
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
    a[-1].write_text(a[-1].read_text() + "\n// a header's change\n")
    assert name_of(a, monkeypatch) not in (same, changed)  # the headers are part of the name too
    # the CPU variant, the flags, the torch version each give their own entry
    assert name_of(a, monkeypatch, "AVX512").startswith("amp_plugin_fused_avx512_")
    assert name_of(a, monkeypatch, "DEFAULT").startswith("amp_plugin_fused_generic_")
    texts = [p.read_bytes() for p in b]
    assert fused.build_name(texts, ["-O3"], "avx2") != fused.build_name(texts, ["-O2"], "avx2")
    assert fused.build_name(texts, ["-O3"], "avx2") == fused.build_name(texts, ["-O3"], "avx2")
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert name_of(b, monkeypatch) != changed
    # parts are length-prefixed: moving bytes from one source to the other changes the name
    assert fused.build_name([b"ab", b"c"], [], "avx2") != fused.build_name([b"a", b"bc"], [], "avx2")


def test_sources_are_staged_inside_the_entry(tmp_path, monkeypatch):
    a = checkout(tmp_path, "a")
    use(a, monkeypatch)
    entry = tmp_path / "entry"
    staged = fused._staged_sources(str(entry))  # the sources to compile; their headers beside them
    assert [Path(p).parent for p in staged] == [entry / "src"] * 2
    assert [Path(p).read_bytes() for p in staged] == [p.read_bytes() for p in a[:2]]
    copies = sorted((entry / "src").iterdir())
    assert [p.name for p in copies] == sorted(p.name for p in a)
    mtimes = [os.stat(p).st_mtime_ns for p in copies]
    b = checkout(tmp_path, "b")  # another checkout with the same sources: the copies stay untouched
    use(b, monkeypatch)
    assert fused._staged_sources(str(entry)) == staged
    assert [os.stat(p).st_mtime_ns for p in copies] == mtimes


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
        staged = sorted(p.name for p in (entry / "src").iterdir())
        assert staged == ["adam_update.h", "emulate.cpp", "fused_simd.h", "master_step.cpp"]


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


# ---------------------------------------------------------------------------------- the first build on a machine
def test_two_environments_get_their_own_entries(monkeypatch):
    """Their build files hold their own include paths: one shared entry would be rebuilt by each in turn."""
    texts = [p.read_bytes() for p in SOURCES]
    here = fused.build_name(texts, ["-O3"], "avx2")
    monkeypatch.setattr(sys, "prefix", "/somewhere/else/venv")
    assert fused.build_name(texts, ["-O3"], "avx2") != here


_FIRST_BUILD = """
import sys, time, warnings
import torch.utils.cpp_extension as cpp
from amp_plugin import fused

def slow_load(**kwargs):
    time.sleep(1.0)  # the compiler's time

cpp.load = slow_load
assert not hasattr(__import__("torch").ops.amp_plugin, "emulation_sync")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fused.kernels()
    fused.kernels()
print(f"seconds={fused.build_seconds():.2f} warnings={len(caught)}")
for warning in caught:
    print("warning:", warning.message)
"""


def _fresh_process(code: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), **extra}
    environment.pop("AMP_PLUGIN_FUSED", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


@pytest.mark.slow
def test_the_first_build_is_announced_once_and_timed(tmp_path):
    result = _fresh_process(_FIRST_BUILD, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stderr.splitlines() if "building the fused C++ CPU kernels" in line]
    assert len(notes) == 1, result.stderr
    assert "this takes 1 to 3 minutes" in notes[0] or "under a minute" in notes[0]
    assert str(tmp_path / "cache") in notes[0] and "not counted in the run's steps/s" in notes[0]
    seconds = float(result.stdout.split("seconds=")[1].split()[0])
    assert 1.0 <= seconds < 30  # what a run leaves out of its wall time
    # not a terminal: no carriage returns, the total on a line of its own after the note
    assert "\r" not in result.stderr
    assert "amp_plugin: compiling the fused kernels: done in 1 s" in result.stderr.splitlines(), result.stderr


@pytest.mark.slow
def test_without_a_compiler_the_stock_path_runs_with_one_warning(tmp_path):
    code = _FIRST_BUILD.replace("cpp.load = slow_load", "")
    result = _fresh_process(code, tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warnings=1" in result.stdout, result.stdout + result.stderr
    assert "no C++ compiler" in result.stdout and "using stock torch ops" in result.stdout
    assert "building the fused" not in result.stderr


def test_a_stale_torch_build_lock_is_removed_and_named(tmp_path, capsys):
    from amp_plugin.fused import _first_build

    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "lock").write_text("")  # what a build killed half-way leaves: torch would wait forever
    with _first_build.build_lock(str(entry), timeout=5):
        assert not (entry / "lock").exists()
    err = capsys.readouterr().err
    assert f"removed {entry / 'lock'}, a build lock left behind by a build that was killed" in err


@pytest.mark.slow
def test_a_live_builder_is_waited_for_with_a_time_limit_naming_the_file(tmp_path, capsys):
    from amp_plugin.fused import _first_build

    entry = tmp_path / "entry"
    code = (
        "import sys, time; from amp_plugin.fused import _first_build\n"
        "with _first_build.build_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(entry)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (entry / "lock").write_text("")  # the live builder's own torch lock: not stale, not removed
        with (
            pytest.raises(_first_build.BuildLockTimeout, match=str(entry / _first_build.LOCK_NAME)),
            _first_build.build_lock(str(entry), timeout=0.5, poll=0.05),
        ):
            pass
        assert (entry / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    assert f"waiting for pid {holder.pid}" in capsys.readouterr().err


@pytest.mark.slow
def test_the_build_is_not_counted_in_a_runs_wall_time(tmp_path, monkeypatch):
    """A build (here: 1.5 s) that happens inside ``fit`` is not training time."""
    import time

    from hydra import compose, initialize_config_dir

    from amp_plugin.app.run import train
    from amp_plugin.app.schema import register_configs
    from amp_plugin.fused import _first_build

    ops = fused.kernels()

    def slow_build():
        with _first_build.timed():
            time.sleep(1.5)
        return ops

    monkeypatch.setitem(fused._state, "tried", False)
    monkeypatch.setattr(fused, "_build", slow_build)
    register_configs()
    with initialize_config_dir(config_dir=str(Path(fused.__file__).parents[2] / "configs"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["recipe=underflow_demo", "trainer.max_steps=2", "plot=false", f"output_dir={tmp_path}"],
        )
    started = time.perf_counter()
    summary = train(cfg)
    assert fused._state["tried"] and time.perf_counter() - started > 1.5  # it was built during the run
    assert summary["wall_time_s"] < 1.5


# ------------------------------------------------------------------------------ the wait, the progress, ahead of time
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "0", "-1", "-0.5", "soon", "1e400"])
def test_a_build_timeout_that_is_not_a_finite_number_of_seconds_is_refused(value, monkeypatch, tmp_path):
    """nan and inf would wait forever on a live build (a comparison with nan is never true), 0 or less not at all."""
    from amp_plugin.fused import _first_build

    monkeypatch.setenv(_first_build.TIMEOUT_ENV, value)
    message = f"AMP_PLUGIN_FUSED_BUILD_TIMEOUT={value!r} is not allowed: .* a finite number > 0 \\(default 1200"
    with pytest.raises(ValueError, match=message):
        fused.build_timeout()
    entry = tmp_path / "entry"
    with pytest.raises(ValueError, match=message), _first_build.build_lock(str(entry)):  # never waited on with it
        pass
    assert not entry.exists()  # refused before anything was written
    with (
        pytest.raises(ValueError, match="timeout=nan: .* a finite number > 0"),
        _first_build.build_lock(str(entry), timeout=float("nan")),
    ):
        pass


@pytest.mark.parametrize("value,seconds", [("", 1200.0), (" ", 1200.0), ("30", 30.0), ("0.5", 0.5), (" 7 ", 7.0)])
def test_a_build_timeout_in_range_is_taken(value, seconds, monkeypatch):
    monkeypatch.setenv("AMP_PLUGIN_FUSED_BUILD_TIMEOUT", value)
    assert fused.build_timeout() == seconds


def test_kernels_raise_on_a_bad_build_timeout_instead_of_running_slower(monkeypatch):
    """A value the user must fix is an error, not a warning and the stock ops."""
    monkeypatch.setenv("AMP_PLUGIN_FUSED_BUILD_TIMEOUT", "nan")
    monkeypatch.setitem(fused._state, "tried", False)
    with pytest.raises(ValueError, match="AMP_PLUGIN_FUSED_BUILD_TIMEOUT='nan'"):
        fused.kernels()
    assert not fused._state["tried"]  # nothing was decided: fixing the value and calling again builds


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_compile_shows_the_time_elapsed_on_one_line_on_a_terminal():
    from amp_plugin.fused import _first_build

    out = _Terminal()
    with _first_build.progress("compiling the fused kernels", stream=out, every=0.02):
        time.sleep(0.15)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, rewritten in place
    updates = text.split("\r")[1:]
    assert len(updates) >= 3
    assert all(u.startswith("amp_plugin: compiling the fused kernels: ") for u in updates)
    assert updates[-1].rstrip("\n").endswith("done in 0 s")


def test_the_compile_progress_is_plain_lines_in_a_log_and_says_when_it_stopped():
    from amp_plugin.fused import _first_build

    out = io.StringIO()
    with pytest.raises(RuntimeError), _first_build.progress("compiling", stream=out, every=0.02):
        time.sleep(0.1)
        raise RuntimeError("the compiler failed")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) >= 3
    assert lines[0] == "amp_plugin: compiling: 0 s"
    assert lines[-1] == "amp_plugin: compiling: stopped after 0 s"


def test_python_m_amp_plugin_fused_builds_ahead_and_says_where(capsys):
    from amp_plugin.fused.__main__ import main

    if fused.kernels() is None:
        assert main(["build"]) == 1
        assert "cannot be built here" in capsys.readouterr().err
        return
    assert main(["build"]) == 0
    out = capsys.readouterr().out
    assert f"amp_plugin: fused kernels ({fused.variant()}) ready: " in out and fused._flags()[0] in out
    assert main(["status"]) == 0
    assert f"({fused.variant()}) built: " in capsys.readouterr().out


def test_python_m_amp_plugin_fused_status_of_an_empty_cache(tmp_path):
    result = _fresh_process(
        "import sys; from amp_plugin.fused.__main__ import main; sys.exit(main(['status']))", tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "not built yet" in result.stdout and str(tmp_path / "cache") in result.stdout
    result = _fresh_process(
        "import sys; from amp_plugin.fused.__main__ import main; sys.exit(main(['build']))",
        tmp_path,
        AMP_PLUGIN_FUSED_BUILD_TIMEOUT="nan",
    )
    assert result.returncode == 2 and "AMP_PLUGIN_FUSED_BUILD_TIMEOUT='nan' is not allowed" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    os.uname().machine != "x86_64", reason="the default build's roundings are those of x86-64 without FMA"
)
def test_the_generic_variant_gives_the_bits_of_torchs_default_build():
    """Where torch's CPU capability is DEFAULT (an x86-64 CPU without AVX2, or ``ATEN_CPU_CAPABILITY=default``),
    torch's fused Adam is its default build, which has no fused multiply-adds and negates for ``maximize``,
    and amp_plugin builds its generic variant: the kernel tests run in a process where that is so, against
    torch's kernel in that process (before, a weight decay's and a moment's product rounded once where torch's
    rounds twice)."""
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestWarning"]
        + [str(tests / name) for name in ("test_fused.py", "test_fused_lean.py")]
        + [str(tests / "test_fused_build.py::test_this_cpu_loads_its_variant")],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
