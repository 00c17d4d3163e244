"""Command-line overrides that Hydra's grammar cannot read, said with the fix instead of a lexer error.

Hydra reads ``key=value`` with a grammar in which ``~`` (delete a key), ``( ) [ ] { } , : ' "``
and ``=`` have a meaning, so an unquoted path such as ``ckpt_path=~/runs/last.ckpt`` fails with
``LexerNoViableAltException`` and a caret, with no word of quoting. :func:`check_overrides` parses
the command line first and, for an override that fails on one of those characters, prints one line
that names the override and the character and shows it quoted (and, for ``~``, that Hydra does not
expand it: the shell's ``$HOME`` does), then exits with status 1. Every other override, and every
other error, stays Hydra's.

One override Hydra can read but not apply: a ``precision.fp8.*`` key with a preset that has no
``precision.fp8`` node (every preset but ``fp8``, where the node is null), which fails inside
OmegaConf with ``AssertionError: Unexpected type for root: NoneType`` and a traceback.
:func:`fp8_without_fp8` composes the chosen preset first and says it as the app says a bad config:
``Invalid configuration: precision.fp8.margin=3 is not allowed with precision=bf16_lean: ...``, exit
status 1, before Hydra creates the run directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SPECIAL", "check_overrides", "explain", "fp8_without_fp8"]

SPECIAL = "~()[]{},:'\"=\\"
"""Characters with a meaning in Hydra's override grammar: inside a value they need quotes."""

# Hydra's flags that take the next argument as their value.
_VALUED = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c", "--cfg", "-p", "--package"}


def _candidates(argv: Sequence[str]) -> list[str]:
    """The arguments that are overrides (``key=value``), not flags or a flag's value."""
    found, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            skip = arg in _VALUED
            continue
        if "=" in arg:
            found.append(arg)
    return found


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def explain(override: str) -> str | None:
    """One line that says how to write ``override`` so that Hydra reads it, or None when Hydra reads it
    as it is (or fails for a reason other than an unquoted special character)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_overrides([override])
        return None
    except Exception:  # Hydra's OverrideParseException (a lexer or parser error)
        pass
    key, _, value = override.partition("=")
    if value.startswith(("'", '"')):
        return None  # already quoted: Hydra's message is about something else
    special = [c for c in value if c in SPECIAL]
    if not special:
        return None
    fixed = f"{key}={_quoted(value)}"
    line = (
        f"Invalid override {override!r}: Hydra's override grammar gives {special[0]!r} a meaning, so a value "
        f"holding it must be quoted: write '{fixed}' (the outer single quotes are for the shell)."
    )
    if value.startswith("~"):
        line += " Hydra does not expand ~ to your home directory: for that, write $HOME/... unquoted and let the shell."
    return line


def _flag(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last of Hydra's flags ``names`` in ``argv`` (``-cd DIR`` or ``--config-dir=DIR``)."""
    found = None
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif "=" in arg and arg.split("=", 1)[0] in names:
            found = arg.split("=", 1)[1]
    return found


def _primary_config(argv: Sequence[str]) -> tuple[str, str] | None:
    """The directory and name of the primary config ``train.py``/``amp-train`` composes, or None when
    ``--config-path`` names a directory relative to code this module cannot see."""
    name = _flag(argv, "-cn", "--config-name") or "train"
    chosen = _flag(argv, "-cp", "--config-path")
    if chosen is not None:
        return (chosen, name) if os.path.isabs(chosen) else None
    script = Path(sys.argv[0]).resolve().parent / "configs"  # train.py's config_path="configs"
    if (script / f"{name}.yaml").is_file():
        return str(script), name
    from amp_plugin.app.cli import config_dir  # amp-train's

    return config_dir(), name


def _compose_choices(directory: str, name: str, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=directory, version_base="1.3"):
        return compose(name, overrides=overrides, return_hydra_config=True)


def fp8_without_fp8(argv: Sequence[str]) -> str | None:
    """The message for a ``precision.fp8.*`` override under a preset without FP8 settings, or None.

    The preset (each of a sweep's, ``-m precision=bf16,fp8``) is composed from the same configs
    (``--config-dir``/``--config-name`` included) to learn whether it has a ``precision.fp8`` node.
    Anything else that fails here is left to Hydra, which says it while composing the run.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(_candidates(argv))
    except Exception:  # a line Hydra cannot read: explain() or Hydra says it
        return None
    # a key under precision.fp8, or a node for it (precision.fp8=null sets what is there: nothing to refuse)
    fp8 = [
        o
        for o in parsed
        if not o.is_delete()
        and (
            o.key_or_group.startswith("precision.fp8.") or (o.key_or_group == "precision.fp8" and o.value() is not None)
        )
    ]
    if not fp8:
        return None
    choice = next((o for o in reversed(parsed) if o.key_or_group == "precision" and not o.is_delete()), None)
    try:
        primary = _primary_config(argv)
        if primary is None:
            return None
        extra = _flag(argv, "-cd", "--config-dir")
        base = [f"hydra.searchpath=[file://{os.path.abspath(extra)}]"] if extra else []
        if choice is None:
            choices: list[str | None] = [None]
        elif choice.is_sweep_override():
            choices = list(choice.sweep_string_iterator())
        else:
            choices = [str(choice.value())]
        for option in choices:
            cfg = _compose_choices(*primary, [*base, *([f"precision={option}"] if option is not None else [])])
            if cfg.precision.get("fp8", None) is None:
                preset = cfg.hydra.runtime.choices.get("precision") or cfg.precision.precision
                line = (fp8[0].input_line or fp8[0].key_or_group).lstrip("+")
                return (
                    f"{line} is not allowed with precision={preset}: precision.fp8.* applies only to precision=fp8 "
                    "(drop it, or choose precision=fp8)."
                )
    except Exception:  # an unknown preset, a missing config: Hydra says it while composing the run
        return None
    return None


def check_overrides(argv: Sequence[str] | None = None) -> None:
    """Exit with status 1 and one line per override (see :func:`explain`) when Hydra could not read one,
    or with ``Invalid configuration: ...`` for FP8 settings under a preset without them (:func:`fp8_without_fp8`)."""
    args = sys.argv[1:] if argv is None else argv
    lines = [line for line in map(explain, _candidates(args)) if line]
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)
    refused = fp8_without_fp8(args)
    if refused:
        print(f"Invalid configuration: {refused}", file=sys.stderr, flush=True)
        sys.exit(1)
