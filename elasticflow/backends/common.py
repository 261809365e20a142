"""What every backend shares: nested parameter dicts <-> flat names, and reading forward()'s output."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..errors import ElasticFlowError


def split_output(out: Any) -> Tuple[Any, Dict[str, Any]]:
    """forward()'s output as (loss, {metric: value}); the backend then checks they are scalars."""
    if not isinstance(out, dict):
        return out, {}
    if "loss" not in out:
        raise ElasticFlowError(f"forward() returned a dict without a 'loss' key (keys: {sorted(out)})",
                               "return {'loss': loss, 'accuracy': acc, ...}")
    return out["loss"], {k: v for k, v in out.items() if k != "loss"}


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
