"""Samples into a batch: items stacked field by field (what a map-style dataset's items, or a sharded corpus's
samples, become without a collate), a read batch as its fields, and the hint for data whose rows differ in length.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ElasticFlowError

Rows = Tuple[np.ndarray, ...]

RAGGED_HINT = ("define collate(samples) in the model file to pad each micro-batch (e.g. transformers."
               "DataCollatorWithPadding(tokenizer)), or pad every row to one length")


def stack(items: List[Any], indices: np.ndarray) -> Rows:
    """Items (arrays, tensors, tuples of them, or dicts) stacked field by field into a batch."""
    first = items[0]
    if isinstance(first, dict):
        keys = list(first)
        items = [tuple(item[k] for k in keys) for item in items]
    elif not isinstance(first, (tuple, list)):
        items = [(item,) for item in items]
    return tuple(stack_field([item[f] for item in items], f, indices) for f in range(len(items[0])))


def stack_field(values: List[Any], field: int, indices: np.ndarray) -> np.ndarray:
    # One C call when the items agree (torch.stack for tensors, as default_collate does; np.stack
    # else); the item-by-item look for the odd one out only when they do not.
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(v, torch.Tensor) for v in values):
        if len({(v.dtype, v.shape) for v in values}) == 1:
            return torch.stack(values).numpy()
    else:
        arrays = [np.asarray(v) for v in values]
        if len({(a.dtype, a.shape) for a in arrays}) == 1:
            return np.stack(arrays)
    arrays = [as_array(v) for v in values]
    for i, a in zip(indices, arrays):
        if a.shape != arrays[0].shape or a.dtype != arrays[0].dtype:
            raise ElasticFlowError(
                f"sample {int(i)}'s field #{field} is {a.dtype} of shape {a.shape}, but sample {int(indices[0])}'s "
                f"is {arrays[0].dtype} of shape {arrays[0].shape}",
                "every sample's field must have one shape and dtype; pad or resize in __getitem__, or define "
                "collate(samples) in the model file to pad each micro-batch")
    return np.stack(arrays)


def as_array(value: Any) -> np.ndarray:
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # a torch or TF tensor
        value = value.detach().cpu() if hasattr(value, "detach") else value
        return np.asarray(value.numpy())
    return np.asarray(value)


def fields_of(batch: Any, names: Optional[Sequence[str]] = None) -> Tuple[Any, ...]:
    """A read batch as its fields. A dict (a collate's ``BatchEncoding``): its values by ``names`` (forward()'s
    data parameters) where it holds every one of them, else in its keys' order."""
    if isinstance(batch, Mapping):
        if names and all(n in batch for n in names):
            return tuple(batch[n] for n in names)
        return tuple(batch.values())
    if isinstance(batch, np.ndarray) or not isinstance(batch, (tuple, list)):
        return (batch,)
    return tuple(batch)


def shown(indices: np.ndarray) -> str:
    head = ", ".join(str(int(i)) for i in indices[:5])
    return f"[{head}{', ...' if len(indices) > 5 else ''}]"


def batch_of(items: List[Any], indices: np.ndarray, collate_fn: Any = None) -> Any:
    """The samples at ``indices`` as one batch: ``collate_fn``'s (``collated``), or stacked field by field."""
    return stack(items, indices) if collate_fn is None else collated(collate_fn, items, indices)


def collated(fn: Any, items: List[Any], indices: np.ndarray) -> Any:
    """``fn(items)``: a collate's batch; what it raises is one error naming it and the samples."""
    try:
        return fn(items)
    except ElasticFlowError:
        raise
    except Exception as exc:
        name = getattr(fn, "__name__", "collate")
        raise ElasticFlowError(f"{name}() raised {type(exc).__name__}: {exc} (on samples {shown(indices)})",
                               f"fix {name}(samples) (run with --debug for the traceback)") from exc
