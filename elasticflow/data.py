"""The global sample order, the data cursor, and one worker's slice of a global batch.

Global step k of an epoch consumes positions [k*B, (k+1)*B) of that epoch's seeded permutation,
whatever the number of workers, so every sample of every epoch is used exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np

from .errors import ElasticFlowError


class Dataset:
    """A checked view of what ``data(cfg)`` returned: a tuple of equal-length arrays, or an indexable."""

    def __init__(self, raw: Any, what: str = "data()"):
        self.what = what
        self.arrays: Tuple[np.ndarray, ...] | None = None
        if isinstance(raw, np.ndarray):
            raw = (raw,)
        if isinstance(raw, dict):
            # A dict has __len__ and __getitem__, but its length counts keys, not samples.
            raise ElasticFlowError(f"{what} returned a dict (keys: {', '.join(map(str, raw))})",
                                   "return a tuple of arrays in forward()'s argument order, e.g. (x, y)")
        if isinstance(raw, (tuple, list)):
            arrays = tuple(np.asarray(a) for a in raw)
            if not arrays:
                raise ElasticFlowError(f"{what} returned an empty tuple", "return a tuple of arrays, e.g. (x, y)")
            lengths = [len(a) if a.ndim else -1 for a in arrays]
            if len(set(lengths)) != 1 or lengths[0] < 0:
                shown = ", ".join(f"#{i}: {n if n >= 0 else 'a scalar'}" for i, n in enumerate(lengths))
                raise ElasticFlowError(f"{what} returned arrays of unequal length ({shown} rows)",
                                       "every array must have one row per sample (same first dimension)")
            self.arrays = arrays
            self.length = lengths[0]
        elif hasattr(raw, "__len__") and hasattr(raw, "__getitem__"):
            self.source = raw
            self.length = len(raw)
        else:
            raise ElasticFlowError(f"{what} returned a {type(raw).__name__}",
                                   "return a tuple of equal-length numpy arrays, or an object with "
                                   "__len__ and __getitem__(indices) returning such a tuple")

    def __len__(self) -> int:
        return self.length

    def fetch(self, indices: np.ndarray) -> Tuple[np.ndarray, ...]:
        """The rows at ``indices`` as a tuple of numpy arrays (only for indexable datasets)."""
        rows = self.source[indices]
        if isinstance(rows, np.ndarray):
            rows = (rows,)
        rows = tuple(np.asarray(r) for r in rows)
        if any(len(r) != len(indices) for r in rows):
            raise ElasticFlowError(f"{self.what}[indices] returned arrays whose length is not len(indices)={len(indices)}",
                                   "__getitem__ must return one row per requested index in every array")
        return rows


def permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global sample order: the same on every worker for the same (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def steps_per_epoch(num_samples: int, global_batch: int, drop_last: bool) -> int:
    full, rest = divmod(num_samples, global_batch)
    return full + (1 if rest and not drop_last else 0)


def split_evenly(total: int, parts: int) -> List[int]:
    """Sizes of ``parts`` contiguous shares of ``total``; the first ``total % parts`` get one more.

    >>> split_evenly(64, 3)
    [22, 21, 21]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def worker_share(batch_positions: Tuple[int, int], rank: int, world: int) -> Tuple[int, int]:
    """This rank's contiguous [start, end) within a global batch's positions [start, end)."""
    start, end = batch_positions
    sizes = split_evenly(end - start, world)
    lo = start + sum(sizes[:rank])
    return lo, lo + sizes[rank]


def micro_batches(start: int, end: int, micro_batch_size: int | None) -> List[Tuple[int, int]]:
    """Split [start, end) into pieces of at most ``micro_batch_size`` (None: one piece)."""
    if end <= start:
        return []
    size = micro_batch_size or (end - start)
    return [(lo, min(lo + size, end)) for lo in range(start, end, size)]


@dataclass
class Cursor:
    """Where training is in the data: replicated state, saved in every checkpoint."""
    epoch: int = 0
    samples_in_epoch: int = 0     # positions of this epoch's permutation already consumed
    samples_seen: int = 0         # all samples consumed since the start of training

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "samples_seen": self.samples_seen}


def global_batch_bounds(samples_in_epoch: int, num_samples: int, global_batch: int) -> Tuple[int, int]:
    return samples_in_epoch, min(samples_in_epoch + global_batch, num_samples)


def check_size(num_samples: int, global_batch: int, what: str = "data()") -> None:
    if num_samples < global_batch:
        raise ElasticFlowError(
            f"{what} has {num_samples} samples, fewer than one global batch of {global_batch}",
            f"lower trainer.global_batch_size to at most {num_samples} or provide more data")


