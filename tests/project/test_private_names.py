"""A leading underscore means private to its package: no module of the project imports another
module's underscore names, or a private module from outside the package that holds it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"amp_plugin": ROOT / "amp_plugin", "amp_plugin.recipes": ROOT / "recipes"}


def module_name(path: Path) -> str:
    for package, folder in SOURCES.items():
        if path.is_relative_to(folder):
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return "benchmarks." + path.stem


def is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "amp_plugin":
        return False
    folder = SOURCES["amp_plugin.recipes"] if parts[1:2] == ["recipes"] else SOURCES["amp_plugin"]
    base = folder.joinpath(*parts[2 if parts[1:2] == ["recipes"] else 1 :])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def crossings(where: str, module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (module ``module``) that reach into another module's or package's
    private parts, each as ``where:line: what``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [alias.name for alias in node.names]
            modules = [node.module, *(f"{node.module}.{n}" for n in names if is_module(f"{node.module}.{n}"))]
            plain = [n for n in names if not is_module(f"{node.module}.{n}")]
        elif isinstance(node, ast.Import):
            modules, plain = [alias.name for alias in node.names], []
        else:
            continue
        modules = [m for m in modules if m.split(".")[0] == "amp_plugin"]
        if not modules:
            continue  # another project's (torch's private modules are torch's business)
        for dotted in modules:
            parts = dotted.split(".")
            private = next(
                (i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")), None
            )
            owner = ".".join(parts[:private]) if private is not None else None
            if owner is not None and package != owner and not package.startswith(owner + "."):
                found.append(f"{where}:{node.lineno}: private module {dotted} from {package}")
        found += [
            f"{where}:{node.lineno}: private name {name} from {node.module}"
            for name in plain
            if name.startswith("_") and not name.startswith("__")
        ]
    return found


def test_no_module_imports_private_names_of_another():
    files = [*SOURCES["amp_plugin"].rglob("*.py"), *SOURCES["amp_plugin.recipes"].rglob("*.py")]
    files += (ROOT / "benchmarks").glob("*.py")
    found = [
        line
        for path in sorted(files)
        for line in crossings(
            str(path.relative_to(ROOT)), module_name(path), path.read_text(), path.name == "__init__.py"
        )
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_a_crossing():
    """The check itself: an app module importing a private name and another package's private
    module, while a package's own modules may import its private modules."""
    source = "from amp_plugin.scaling.unscale import _hidden\nfrom amp_plugin.master_weights import _grads\n"
    assert not crossings("inside", "amp_plugin.master_weights._optimizer", source.split("\n")[1])
    found = crossings("probe", "amp_plugin.app.probe", source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "private name _hidden from amp_plugin.scaling.unscale",
        "private module amp_plugin.master_weights._grads from amp_plugin.app",
    ]
