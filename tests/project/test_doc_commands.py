"""Every shell command in README.md, docs/ and CHANGELOG.md works as written.

Fenced shell blocks (```bash, ```sh, ```console, or a bare ``` block of ``$ `` lines) are run, with a tiny
step count; a block that cannot run here (GPUs, SLURM, torchrun across nodes) says so right before it with
``<!-- not-runnable: why -->``. Commands written inline (`` `python train.py precision=bf16` ``) are checked
without training: their modules and console scripts exist, and their overrides compose into a valid config.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"(?P<marks>(?:<!-- [\w-]+:[^>]*-->\n)*)```(?P<lang>[\w-]*)\n(?P<body>.*?)```", re.S)
MARK = re.compile(r"<!-- ([\w-]+):\s*([^>]*?)\s*-->")
INLINE = re.compile(r"`((?:python (?:[\w/]+\.py|-m)|amp-\w+)[^`]*)`")
TINY = ["trainer.max_steps=2", "trainer.limit_val_batches=1", "plot=false"]
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; the project runs on 3.10)


def toml_table(name: str) -> str:
    return PYPROJECT.split(f"\n[{name}]\n", 1)[1].split("\n[", 1)[0]


SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', toml_table("project.scripts"), re.M))  # amp-train -> module:main
EXTRAS = re.findall(r"^([\w-]+) = \[", toml_table("project.optional-dependencies"), re.M)
CI = (ROOT / ".ci" / "run").read_text()


@dataclass
class Block:
    page: str
    line: int
    lang: str
    body: str
    marks: dict[str, str]

    @property
    def commands(self) -> list[str]:
        """The commands of the block: its ``$ `` lines, or every line that is not a comment."""
        lines = self.body.replace("\\\n", " ").splitlines()
        if any(line.startswith("$ ") for line in lines):
            return [line[2:].strip() for line in lines if line.startswith("$ ")]
        return [re.sub(r"\s+#\s.*$", "", line).strip() for line in lines if line.strip() and not line.startswith("#")]

    def output_of(self, command: str) -> list[str]:
        """The lines a console block shows after ``$ command``, up to the next command."""
        lines = self.body.splitlines()
        if f"$ {command}" not in lines:
            return []
        shown = lines[lines.index(f"$ {command}") + 1 :]
        return shown[: next((i for i, line in enumerate(shown) if line.startswith("$ ")), len(shown))]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def shell_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            lang, body = m["lang"], m["body"]
            if lang in SHELL_LANGS or (lang == "" and re.search(r"^\$ ", body, re.M)):
                line = text.count("\n", 0, m.start("lang")) + 1
                blocks.append(Block(str(page.relative_to(ROOT)), line, lang, body, dict(MARK.findall(m["marks"]))))
    return blocks


BLOCKS = shell_blocks()
RUNNABLE = [b for b in BLOCKS if "not-runnable" not in b.marks]


def test_every_shell_block_is_run_or_says_why_not():
    assert len(RUNNABLE) >= 5
    for block in BLOCKS:
        assert block.marks.get("not-runnable", "x").strip(), f"{block}: a not-runnable mark says why"
        assert set(block.marks) <= {"not-runnable", "exit-status"}, f"{block}: unknown mark {block.marks}"
    marked = [b for b in BLOCKS if "not-runnable" in b.marks]
    for block in marked:  # only what this machine cannot do is marked
        why = block.marks["not-runnable"]
        assert re.search(r"GPU|SLURM|torchrun|nodes", why), f"{block}: {why!r} is not a reason to skip a command"


def test_the_readme_starts_with_the_install_and_run_and_the_test_commands():
    first, second = BLOCKS[0], BLOCKS[1]
    assert first.page == second.page == "README.md"
    assert first.commands == ['pip install torch==2.13.0 && pip install -e ".[lightning]" && python train.py']
    assert second.commands == [f'pip install torch==2.13.0 && pip install -e ".[test]" && {ci_test_command()}']


def ci_test_command() -> str:
    (command,) = [line for line in CI.splitlines() if line.startswith("python -m pytest")]
    return command


def check_install(part: str) -> None:
    """``pip install`` of the pinned torch or of this project's extras: what .ci/run installs too."""
    words = shlex.split(part)[2:]
    if words[0].startswith("torch=="):
        assert words[0] == f"torch=={torch.__version__.split('+')[0]}", part
        assert f"pip install --quiet {words[0]}" in CI
        return
    assert words[0] == "-e", f"{part}: only torch and this project are installed by the docs' commands"
    extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[1])
    assert extras, part
    for extra in (extras[1] or "").split(","):
        assert not extra or extra in EXTRAS, f"{part}: no extra {extra!r}"


def argv(part: str) -> list[str]:
    """The command as this checkout runs it: console scripts call their module (they point at the
    installed copy), ``python`` is this interpreter."""
    words = shlex.split(part)
    if words[0] in SCRIPTS:
        module = SCRIPTS[words[0]].split(":")[0]
        head = ["train.py"] if module == "amp_plugin.app.cli" else ["-m", module]
        words = ["python", *head, *words[1:]]
    assert words[0] == "python", (
        f"{part}: not a command this test knows; mark the block not-runnable if it needs a cluster"
    )
    return [sys.executable, *words[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_the_commands_of_each_block_run(block, tmp_path):
    sweep: Path | None = None
    for n, command in enumerate(block.commands):
        for part in command.split(" && "):
            if part.startswith("pip install"):
                check_install(part)
                continue
            if part.startswith("python -m pytest"):
                assert part == ci_test_command(), f"{block}: the test command is .ci/run's"
                continue
            args = argv(part)
            if args[1] == "train.py" and not {"--help", "--cfg"} & set(args):
                args = [a for a in args if not a.startswith("trainer.max_steps=")] + TINY
                out = tmp_path / f"run{n}"
                args += [f"hydra.sweep.dir={out}" if "-m" in args else f"hydra.run.dir={out}"]
                sweep = out if "-m" in args else sweep
            if args[1:3] == ["-m", "amp_plugin.app.gate"]:  # two tiny paired runs, in this test's directory
                args = [a for a in args if not a.startswith("trainer.max_steps=")] + TINY
                args += ["--dir", str(tmp_path / f"gate{n}")]
                if "--seeds" in args:
                    args[args.index("--seeds") + 1] = "2"
            args = [a.replace("multirun/<date>/<time>", str(sweep)) for a in args]
            assert not any("<" in a for a in args), f"{block}: a placeholder in {part!r}"
            done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
            expected = int(block.marks.get("exit-status", 0))
            assert done.returncode == expected, f"{block}: {part!r} exited {done.returncode}\n{done.stderr[-3000:]}"
            shown = block.output_of(command)
            if len(shown) == 1:  # a one-line answer (an error message) is shown as the command prints it
                assert shown[0] in done.stdout + done.stderr, f"{block}: {part!r} no longer prints {shown[0]!r}"


def inline_commands() -> list[tuple[str, str]]:
    return [(page.name, m[1]) for page in PAGES for m in INLINE.finditer(page.read_text())]


def test_inline_commands_name_modules_and_scripts_that_exist():
    commands = inline_commands()
    assert len(commands) > 10
    for page, command in commands:
        words = command.split()
        if words[0] in SCRIPTS or words[0].startswith("amp-"):
            assert words[0] in SCRIPTS, f"{page}: no console script {words[0]!r} in pyproject.toml"
        elif words[1].endswith(".py"):
            assert (ROOT / words[1]).is_file(), f"{page}: `{command}`: no {words[1]}"
        elif words[1] == "-m" and words[2] != "pytest":
            spec = importlib.util.find_spec(words[2])
            assert spec is not None and spec.origin, f"{page}: `{command}`: no module {words[2]}"
            main = Path(spec.origin)
            if spec.submodule_search_locations:  # a package: python -m runs its __main__.py
                main = main.with_name("__main__.py")
                assert main.is_file(), f"{page}: `{command}`: package {words[2]} has no __main__.py"
            assert '__name__ == "__main__"' in main.read_text(), f"{page}: {words[2]} cannot be run"


def overrides_of(command: str) -> list[str]:
    """The overrides an inline ``python train.py ...`` composes with: flags, Hydra's own keys and
    placeholders (``<dir>``, ``N``, ``...``) dropped, and the first value of a sweep."""
    words, out, skip = command.split()[2:], [], False
    for word in words:
        if skip or word in ("-m", "--help", "..."):
            skip = False
            continue
        if word in ("--cfg", "--config-dir"):
            skip = True
            continue
        key, _, value = word.partition("=")
        if not value or key.lstrip("+").startswith("hydra") or "<" in word or re.fullmatch(r"[A-Z_]+", value):
            continue
        out.append(f"{key}={value.split(',')[0]}" if "[" not in value else word)
    return out


@pytest.mark.slow
def test_inline_train_commands_compose_into_a_valid_config(compose_config):
    from amp_plugin.app.build import prepare

    checked = 0
    for page, command in inline_commands():
        if not command.startswith("python train.py") or "--config-dir" in command:
            continue
        overrides = overrides_of(command)
        try:
            cfg = compose_config(*overrides)
            if "precision=fp32" in overrides and "scaler=static" in overrides:
                continue  # shown as a contradiction the app refuses
            prepare(cfg)
        except Exception as error:  # any failure: the message names the command
            pytest.fail(f"{page}: `{command}` does not compose: {error}")
        checked += 1
    assert checked >= 4


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_between_the_pages_lead_somewhere():
    pages = [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "RELIABILITY.md"]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
