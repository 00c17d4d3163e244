"""Command-line overrides that Hydra's grammar cannot read, said with the fix instead of a lexer error.

Hydra reads ``key=value`` with a grammar in which ``~`` (delete a key), ``( ) [ ] { } , : ' "``
and ``=`` have a meaning, so an unquoted path such as ``ckpt_path=~/runs/last.ckpt`` fails with
``LexerNoViableAltException`` and a caret, with no word of quoting. :func:`check_overrides` parses
the command line first and, for an override that fails on one of those characters, prints one line
that names the override and the character and shows it quoted (and, for ``~``, that Hydra does not
expand it: the shell's ``$HOME`` does), then exits with status 1. Every other override, and every
other error, stays Hydra's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["SPECIAL", "check_overrides", "explain"]

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


def check_overrides(argv: Sequence[str] | None = None) -> None:
    """Exit with status 1 and one line per override (see :func:`explain`) when Hydra could not read one."""
    lines = [line for line in map(explain, _candidates(sys.argv[1:] if argv is None else argv)) if line]
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)
