"""Nested parameter dicts <-> flat names joined with "/" (shared by every backend)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple


def flatten(tree: Dict[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    """[(name, leaf)] in insertion order; nested dicts join their keys with "/"."""
    items: List[Tuple[str, Any]] = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            items.extend(flatten(value, name + "/"))
        else:
            items.append((name, value))
    return items


def rebuild(tree: Dict[str, Any], leaves: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``tree``'s shape with each leaf replaced by ``leaves[name]``."""
    return {k: rebuild(v, leaves, f"{prefix}{k}/") if isinstance(v, dict) else leaves[f"{prefix}{k}"]
            for k, v in tree.items()}
