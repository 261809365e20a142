"""A corpus kept as shard files, read exactly once per epoch by any number of workers: ``Shards``.

Each shard is indexed once (its rows, and where each row lies: ``shard_formats``) and the index is cached where
only its user can write, under ``~/.cache/elasticflow/index``, never beside the data (``index_cache``); a file
that changes is indexed again. An index array with a row per sample is read from its file as needed, so
memory does not grow with the corpus. The corpus is then readable at any index, so the exactly-once machinery of
map-style data applies unchanged: global batches are positions in an epoch's order, dealt by position.

The order keeps reads local: the shards in a shuffled order, then the samples of each window of ``window``
consecutive shards shuffled together (``WindowOrder``). A global batch draws from one window (two at a window's
edge), so each worker reads from a few files at a time, and the order is a function of the seed, the epoch and the
shards' row counts only: the same for any number of workers.
"""
from __future__ import annotations

import glob
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ..errors import ElasticFlowError
from . import shard_formats
from .index_cache import cached_index
from .samples import batch_of


class Shards:
    """Samples stored in shard files: jsonl, parquet, ``.npy``, raw ``.bin`` tokens, WebDataset ``.tar``
    (by suffix; one corpus may mix them).

    Args:
        files: a glob pattern, a path, or a list of them; shards are taken in sorted path order.
        window: shards whose samples are shuffled together (default 4); more mixes wider and reads from more
            files at once.
        seq_len: for flat token files (``.bin``, 1-D ``.npy``): tokens per sample.
        dtype: for ``.bin``: the token dtype (default ``uint16``, as nanoGPT writes them).
        collate_fn: makes a micro-batch from its samples (default: the model file's ``collate``, else samples
            stacked field by field, a dict's values in its keys' order).

    Example::

        def data(cfg):
            return elasticflow.data.Shards("corpus/train-*.jsonl")

        def collate(samples):          # [{"text": ...}, ...] -> forward()'s arguments
            return tokenize_and_pad([s["text"] for s in samples])

    Note: each epoch visits every sample once in an order shuffled within windows of shards, not a full
    permutation: two samples share a global batch only if their shards share a window (see docs/data.md).
    """

    def __init__(self, files: Union[str, Sequence[str]], *, window: int = 4, seq_len: Optional[int] = None,
                 dtype: Optional[str] = None, collate_fn: Optional[Callable[[List[Any]], Any]] = None):
        if int(window) < 1:
            raise ElasticFlowError(f"Shards(): window={window}", "pass window >= 1 (shards shuffled together)")
        self.paths = _resolve(files)
        self.window, self.collate_fn = int(window), collate_fn
        options = {"seq_len": seq_len, "dtype": dtype}
        self.shards = [shard_formats.format_of(p)(p, cached_index(p, options)) for p in self.paths]
        empty = [p for p, s in zip(self.paths, self.shards) if len(s) == 0]
        self.shards = [s for s in self.shards if len(s)]
        if not self.shards:
            raise ElasticFlowError(f"Shards(): the {len(self.paths)} file(s) hold no sample ({empty[0]} ...)",
                                   "check the files' contents and format")
        self.counts = np.asarray([len(s) for s in self.shards], dtype=np.int64)
        self.offsets = np.r_[0, np.cumsum(self.counts)]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> "WindowOrder":
        """The epoch's order of sample ids (see ``WindowOrder``)."""
        return WindowOrder(self.counts, self.window, seed, epoch, shuffle, ahead=self._read_ahead)

    def _read_ahead(self, shards: np.ndarray) -> None:
        for s in shards.tolist():
            self.shards[s].read_ahead()

    def read(self, indices: np.ndarray) -> Any:
        return batch_of(self.samples(indices), indices, self.collate_fn)

    def samples(self, indices: np.ndarray) -> List[Any]:
        """The samples at global ``indices``, in that order: each shard read once, its rows in file order."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        out: List[Any] = [None] * len(indices)
        for s in np.unique(which):
            at = np.flatnonzero(which == s)
            rows = indices[at] - self.offsets[s]
            order = np.argsort(rows, kind="stable")
            for i, sample in zip(at[order], self.shards[s].read(rows[order])):
                out[i] = sample
        return out


def _resolve(files: Union[str, Sequence[str]]) -> List[str]:
    patterns = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not patterns:
        raise ElasticFlowError("Shards() got no file", 'pass a glob pattern, e.g. "corpus/*.jsonl", or a list of paths')
    paths: List[str] = []
    for pattern in map(str, patterns):
        found = sorted(glob.glob(os.path.expanduser(pattern)))
        if not found:
            raise ElasticFlowError(f"Shards(): no file matches {pattern!r}",
                                   "check the path (relative paths start where elasticflow train was run)")
        paths += found
    for p in paths:
        shard_formats.format_of(p)  # refuses an unknown suffix before any file is indexed
    return sorted(dict.fromkeys(os.path.abspath(p) for p in paths))


# ---------------------------------------------------------------- the order
class WindowOrder:
    """An epoch's sample ids, computed a window at a time (memory: one or two windows, never the corpus).

    The shards in an order shuffled by (seed, epoch); each run of ``window`` consecutive shards in that order
    is a window, whose samples are shuffled together by (seed, epoch, window). ``shuffle`` False: the shards
    and their rows in storage order. ``order[a:b]`` is the ids at positions a..b-1. ``ahead(shards)`` is told
    the next window's shards as a window is first sliced, to start reading them while this one is read.
    """

    def __init__(self, counts: np.ndarray, window: int, seed: int, epoch: int, shuffle: bool,
                 ahead: Optional[Callable[[np.ndarray], None]] = None):
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        offsets = np.r_[0, np.cumsum(counts)]
        shards = np.random.default_rng([seed, epoch, 0]).permutation(len(counts)) if shuffle else np.arange(len(counts))
        self.windows = [shards[i:i + window] for i in range(0, len(shards), window)]
        self.starts = np.r_[0, np.cumsum([counts[w].sum() for w in self.windows])]
        self.offsets, self.counts = offsets, counts
        self._kept: Dict[int, np.ndarray] = {}
        self._ahead, self._told = ahead, set()
        self._lock = threading.Lock()  # prefetch threads slice the order too

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, where: slice) -> np.ndarray:
        if not isinstance(where, slice) or where.step not in (None, 1):
            raise TypeError("a WindowOrder is read by contiguous slices (order[a:b])")
        a, b, _ = where.indices(len(self))
        if b <= a:
            return np.empty(0, dtype=np.int64)
        first, last = (int(np.searchsorted(self.starts, p, side="right")) - 1 for p in (a, b - 1))
        parts = [self._window(w) for w in range(first, last + 1)]
        if self._ahead is not None and last + 1 < len(self.windows) and last + 1 not in self._told:
            self._told.add(last + 1)  # once (a thread racing here tells it twice: harmless)
            self._ahead(self.windows[last + 1])
        ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return ids[a - int(self.starts[first]):b - int(self.starts[first])]

    def _window(self, w: int) -> np.ndarray:
        with self._lock:
            ids = self._kept.get(w)
            if ids is None:
                ids = np.concatenate([np.arange(self.offsets[s], self.offsets[s] + self.counts[s])
                                      for s in self.windows[w]])
                if self.shuffle:
                    ids = np.random.default_rng([self.seed, self.epoch, 1 + w]).permutation(ids)
                self._kept[w] = ids
                for old in [k for k in self._kept if k < w - 1 or k > w + 1]:  # keep this window's neighbours only
                    del self._kept[old]
            return ids
