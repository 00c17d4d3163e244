"""Reading composed config nodes: plain copies, the entries of a group, and error messages that name the key.

Shared by :mod:`amp_plugin.app.build` (which builds a run from the nodes) and
:mod:`amp_plugin.app.run` (which reports what Lightning rejects while it sets the run up).
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf

from amp_plugin.app.validation import show

__all__ = ["entries", "key_path", "naming_key", "plain"]


def plain(node: Any) -> dict[str, Any]:
    """A resolved, plain copy of a config node (Enum choices as their strings)."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]
    return dict(node)


def naming_key(key: str, config: dict[str, Any], err: BaseException) -> str:
    """``err``'s message, with the config key in front: ``lr=-1.0 ...`` -> ``recipe.lr=-1.0 ...``.

    The name may be a key of a nested node of ``config``: ``margin=20 ...`` from the FP8 recipe,
    built from ``precision.fp8``, becomes ``precision.fp8.margin=20 ...`` (:func:`key_path`).
    """
    text = " ".join(str(err).split()) or type(err).__name__
    leading = re.match(r"(\w+)=", text)
    if leading:  # our constructors: "name=value is not allowed: ..."
        name = leading.group(1)
        path = key_path(config, name, text[len(leading.group(0)) :])
        return f"{key}.{path}{text[len(name) :]}" if path is not None else text
    # Other messages (Lightning's "`max_steps` must be ...") name the argument somewhere: a key of
    # the node itself first, else one of a nested node (Fp8Recipe's "unknown FP8 setting(s) ['foo']").
    words = [word for word in re.findall(r"\w+", text) if not word.startswith("_")]
    named = next((word for word in words if word in config), None)
    if named is None:
        named = next((path for path in (key_path(config, word) for word in words) if path is not None), None)
    if named is not None:
        return f"{key}.{named}={show(_at(config, named))} is not allowed: {text}"
    return f"{key}: {text}"


def key_path(config: dict[str, Any], name: str, shown: str = "") -> str | None:
    """The dotted path of key ``name`` in ``config`` or a node nested in it (``"fp8.margin"``), or None.

    A key of ``config`` itself comes first, then the shallowest nested one; among nested keys of the
    same name, one whose value is written at the start of ``shown`` (what the message says after
    ``name=``) first.
    """
    if name in config:
        return name
    found: list[tuple[int, str, Any]] = []

    def walk(node: dict[str, Any], prefix: str, depth: int) -> None:
        for child, value in node.items():
            if not isinstance(child, str) or child.startswith("_"):
                continue
            if child == name and depth:
                found.append((depth, prefix + child, value))
            if isinstance(value, dict):
                walk(value, f"{prefix}{child}.", depth + 1)

    walk(config, "", 0)
    if not found:
        return None
    found.sort(key=lambda item: item[0])  # stable: module order within a depth
    said = [path for _, path, value in found if any(w and shown.startswith(w) for w in (show(value), repr(value)))]
    return said[0] if said else found[0][1]


def _at(config: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        config = config[part]
    return config


def entries(node: Any) -> list[tuple[str, Any]]:
    """A group's nodes to instantiate: one ``_target_`` node, or a dict of them by name (nulls dropped)."""
    if node is None:
        return []
    if not OmegaConf.is_dict(node) or "_target_" in node:
        return [("", node)]
    return [(name, entry) for name, entry in node.items() if entry is not None]
