"""Reading composed config nodes: plain copies, the entries of a group, and error messages that name the key.

Shared by :mod:`amp_plugin.app.build` (which builds a run from the nodes) and
:mod:`amp_plugin.app.run` (which reports what Lightning rejects while it sets the run up).
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf

from amp_plugin.app.validation import show

__all__ = ["entries", "naming_key", "plain"]


def plain(node: Any) -> dict[str, Any]:
    """A resolved, plain copy of a config node (Enum choices as their strings)."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]
    return dict(node)


def naming_key(key: str, config: dict[str, Any], err: BaseException) -> str:
    """``err``'s message, with the config key in front: ``lr=-1.0 ...`` -> ``recipe.lr=-1.0 ...``."""
    text = " ".join(str(err).split()) or type(err).__name__
    leading = re.match(r"(\w+)=", text)
    if leading:  # our constructors: "name=value is not allowed: ..."
        return f"{key}.{text}" if leading.group(1) in config else text
    # Other messages (Lightning's "`max_steps` must be ...") name the argument somewhere.
    named = next((word for word in re.findall(r"\w+", text) if word in config and not word.startswith("_")), None)
    if named is not None:
        return f"{key}.{named}={show(config[named])} is not allowed: {text}"
    return f"{key}: {text}"


def entries(node: Any) -> list[tuple[str, Any]]:
    """A group's nodes to instantiate: one ``_target_`` node, or a dict of them by name (nulls dropped)."""
    if node is None:
        return []
    if not OmegaConf.is_dict(node) or "_target_" in node:
        return [("", node)]
    return [(name, entry) for name, entry in node.items() if entry is not None]
