"""Build the fused kernels now, not in the first run: ``python -m amp_plugin.fused build``.

    python -m amp_plugin.fused build    # compile (or load the cached build) and say where it is
    python -m amp_plugin.fused status   # whether this environment's build is cached, without building

Run it once after ``pip install`` (in a Dockerfile, a CI image, a cluster's setup job) and every
later run, in that environment with these sources, loads the cached build in a second or two. It
builds for the CPU it runs on (the variant is in the entry's name), in ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), and honours ``AMP_PLUGIN_FUSED_BUILD_TIMEOUT``; asked for by
name, it builds even with ``AMP_PLUGIN_FUSED=0`` set. Exit
status 0 when the kernels load, 1 when they cannot be built here (the reason is printed; runs then
use stock torch ops), 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from amp_plugin import fused


def _entry() -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(fused._flags()[0], False)


def build() -> int:
    os.environ.pop(fused.ENV_SWITCH, None)  # asked for by name: AMP_PLUGIN_FUSED=0 does not skip it
    entry = _entry()
    cached = os.path.exists(os.path.join(entry, f"{os.path.basename(entry)}.so"))
    start = time.perf_counter()
    try:
        ops = fused.kernels()
    except ValueError as err:  # a bad AMP_PLUGIN_FUSED_BUILD_TIMEOUT
        print(f"amp_plugin: {err}", file=sys.stderr)
        return 2
    if ops is None:
        print(f"amp_plugin: the fused kernels cannot be built here: {fused.unavailable_reason()}", file=sys.stderr)
        return 1
    how = "loaded the cached build" if cached else "built"
    print(f"amp_plugin: fused kernels ({fused.variant()}) ready: {how} in {time.perf_counter() - start:.1f} s, {entry}")
    return 0


def status() -> int:
    entry = _entry()
    cached = os.path.exists(os.path.join(entry, f"{os.path.basename(entry)}.so"))
    state = "built" if cached else "not built yet (the first run builds it, or: python -m amp_plugin.fused build)"
    print(f"amp_plugin: fused kernels ({fused.variant()}) {state}: {entry}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m amp_plugin.fused", description=__doc__.split("\n")[0], epilog="See docs/runs.md."
    )
    parser.add_argument("command", choices=("build", "status"), help="build: compile or load; status: say only")
    args = parser.parse_args(argv)
    return build() if args.command == "build" else status()


if __name__ == "__main__":
    sys.exit(main())
