"""The dataset forms ``data()`` may return, each turned into one shape: ``len()`` and ``fetch(indices)``
returning a tuple of numpy arrays with one row per index.

Forms: a tuple of arrays held in memory (the trainer keeps those resident, see ``data.Dataset``);
arrays memory-mapped from disk (``np.load(path, mmap_mode="r")``, or :class:`NpyShards` for a
directory of ``.npy`` shards), read batch by batch; an object whose ``__getitem__`` takes an array
of indices; a map-style ``torch.utils.data.Dataset`` (one item per index, optional ``collate_fn``,
see :class:`Mapped`); a Hugging Face ``datasets.Dataset`` (batched column reads, see
:class:`Columns`). Iterable-only sources are refused: exactly-once needs random access.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ElasticFlowError
from .rows import DiskRows
from .samples import RAGGED_HINT, Rows, batch_of, collated, shown


class Mapped:
    """A map-style dataset read one item per index (``torch.utils.data.Dataset`` and the like).

    Each item is an array, a tuple of arrays (``forward()``'s argument order) or a dict (its keys'
    order); items are stacked into a batch, or passed to ``collate_fn`` (which returns a tuple of
    arrays or tensors, as torch's ``default_collate`` does). A ``torch.utils.data.Dataset``
    returned from ``data()`` is wrapped in this for you.

    Example::

        def data(cfg):
            return elasticflow.data.Mapped(MyImages("train/"), collate_fn=pad_batch)
    """

    def __init__(self, dataset: Any, collate_fn: Optional[Callable[[List[Any]], Any]] = None):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ElasticFlowError(f"Mapped() got a {type(dataset).__name__}, which has no __len__ and __getitem__",
                                   "pass a map-style dataset: dataset[i] returns sample i")
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: np.ndarray) -> Any:
        return batch_of([self.dataset[int(i)] for i in indices], indices, self.collate_fn)


class Columns:
    """A Hugging Face ``datasets.Dataset`` read by batched column access (no per-item Python loop).

    ``columns`` picks and orders the columns that become ``forward()``'s arguments; without them
    every column is used in the dataset's own order. Returning the dataset itself from ``data()``
    means ``Columns(dataset)``. ``collate_fn`` (the model file's ``collate(samples)`` is passed for
    you): each micro-batch's rows, as a list of ``{column: value}`` samples, become the batch it
    returns (``transformers.DataCollatorWithPadding`` pads ragged token ids per micro-batch).

    Example::

        def data(cfg):
            ds = datasets.load_from_disk("mnist")
            return elasticflow.data.Columns(ds, "pixels", "label")
    """

    def __init__(self, dataset: Any, *columns: str, collate_fn: Optional[Callable[[List[Any]], Any]] = None):
        names = list(getattr(dataset, "column_names", None) or [])
        missing = [c for c in columns if c not in names]
        if missing:
            raise ElasticFlowError(f"Columns(): the dataset has no column {', '.join(map(repr, missing))}",
                                   f"its columns are {', '.join(map(repr, names))}")
        self.columns = list(columns) or names
        self.collate_fn = collate_fn
        # numpy format: a batch read returns arrays, not lists of Python objects (a collate takes the lists)
        self.dataset = dataset.with_format(None if collate_fn else "numpy", columns=self.columns)

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: np.ndarray) -> Any:
        batch = self.dataset[indices.tolist()]
        if self.collate_fn is not None:
            rows = [dict(zip(self.columns, row)) for row in zip(*(batch[c] for c in self.columns))]
            return collated(self.collate_fn, rows, indices)
        fields = tuple(np.asarray(batch[c]) for c in self.columns)
        for c, f in zip(self.columns, fields):
            if f.dtype == object:
                raise ElasticFlowError(f"column {c!r} holds rows of different lengths (samples {shown(indices)})",
                                       RAGGED_HINT)
        return fields


class Samples:
    """A tuple of fields held in memory whose rows may differ in length (ragged token ids), made into
    micro-batches by ``collate_fn``: it receives the micro-batch's samples, each a tuple of its fields."""

    def __init__(self, fields: Sequence[Any], collate_fn: Callable[[List[Any]], Any]):
        self.fields, self.collate_fn = fields, collate_fn

    def __len__(self) -> int:
        return len(self.fields[0])

    def read(self, indices: np.ndarray) -> Any:
        return collated(self.collate_fn, [tuple(f[int(i)] for f in self.fields) for i in indices], indices)


class NpyShards:
    """Arrays stored as ``.npy`` shards on disk, memory-mapped: one glob pattern per array, shards
    concatenated in sorted file-name order. Only the rows of each batch are read.

    Example::

        def data(cfg):  # train/x-000.npy, train/x-001.npy, ... and train/y-000.npy, ...
            return elasticflow.data.NpyShards("train/x-*.npy", "train/y-*.npy")
    """

    def __init__(self, *patterns: str):
        if not patterns:
            raise ElasticFlowError("NpyShards() got no pattern", 'pass one glob per array, e.g. "x-*.npy", "y-*.npy"')
        self.arrays: List[List[DiskRows]] = []
        self.offsets: List[np.ndarray] = []
        for pattern in patterns:
            files = sorted(glob.glob(os.path.expanduser(pattern)))
            if not files:
                raise ElasticFlowError(f"NpyShards(): no file matches {pattern!r}",
                                       "check the path (relative paths start where elasticflow train was run)")
            shards = [DiskRows(np.load(f, mmap_mode="r")) for f in files]
            for f, s in zip(files, shards):
                if s.shape[1:] != shards[0].shape[1:] or s.dtype != shards[0].dtype:
                    raise ElasticFlowError(
                        f"NpyShards(): {f} holds {s.dtype} rows of shape {s.shape[1:]}, but {files[0]} holds "
                        f"{shards[0].dtype} rows of shape {shards[0].shape[1:]}",
                        "every shard of one array must have the same row shape and dtype")
            self.arrays.append(shards)
            self.offsets.append(np.cumsum([0] + [len(s) for s in shards]))
        totals = [int(o[-1]) for o in self.offsets]
        if len(set(totals)) != 1:
            raise ElasticFlowError(f"NpyShards(): the patterns hold different numbers of rows "
                                   f"({', '.join(f'{p!r}: {n}' for p, n in zip(patterns, totals))})",
                                   "every array needs one row per sample")
        self.length = totals[0]

    def __len__(self) -> int:
        return self.length

    def read(self, indices: np.ndarray) -> Rows:
        return tuple(_read_sharded(shards, offsets, indices) for shards, offsets in zip(self.arrays, self.offsets))


def _read_sharded(shards: List[DiskRows], offsets: np.ndarray, indices: np.ndarray) -> np.ndarray:
    which = np.searchsorted(offsets, indices, side="right") - 1
    out = np.empty((len(indices),) + shards[0].shape[1:], dtype=shards[0].dtype)
    for s in np.unique(which):
        hit = which == s
        out[hit] = shards[s].read(indices[hit] - offsets[s])
    return out


class Mmapped:
    """A tuple of arrays of which at least one is memory-mapped: rows are read per batch, never all."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = tuple(DiskRows(a) if isinstance(a, np.memmap) else a for a in arrays)

    def __len__(self) -> int:
        return len(self.arrays[0])

    def read(self, indices: np.ndarray) -> Rows:
        return tuple(a.read(indices) if isinstance(a, DiskRows) else a[indices] for a in self.arrays)


class Indexed:
    """An object whose ``__getitem__`` takes an array of indices and returns a tuple of arrays."""

    def __init__(self, source: Any):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices: np.ndarray) -> Any:
        return self.source[indices]


def _is_instance(raw: Any, module: str, names: Tuple[str, ...]) -> bool:
    """isinstance against a class of a package, without importing the package (it is loaded if
    the object came from it)."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    for name in names:
        obj = mod
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and isinstance(raw, obj):
            return True
    return False


_RANDOM_ACCESS = ("exactly-once training deals each global batch by sample index, so the source must "
                  "be readable at any index")


def _tf_data_fix(ds: Any) -> str:
    """The arrays a ``tf.data.Dataset`` reads, as code for its element structure: a dict's values by key (iterating
    a dict gives its keys), a tuple's fields, or the one tensor; a batched one unbatched first."""
    spec = getattr(ds, "element_spec", None)
    batched, node = False, ds
    while node is not None and not batched:  # ds.batch(n) somewhere in its pipeline (.prefetch() after it...)
        batched = "Batch" in type(node).__name__
        node = getattr(node, "_input_dataset", None)
    rows = f"rows = list(ds{'.unbatch()' if batched else ''}.as_numpy_iterator()); "
    if isinstance(spec, dict):
        arrays = f"tuple(np.stack([r[k] for r in rows]) for k in {tuple(spec)!r})"
        order = " (order the keys as forward()'s arguments)"
    elif isinstance(spec, tuple):
        arrays, order = "tuple(np.stack(field) for field in zip(*rows))", ""
    else:
        arrays, order = "(np.stack(rows),)", ""
    return (f"return the arrays it reads: {rows}return {arrays}{order}; or, for data too large for memory, "
            "files read by elasticflow.data.Shards/NpyShards")


def refuse_iterable(raw: Any, what: str) -> None:
    """Iterable-only sources cannot be read at a given index: say why, and what to return instead."""
    kind = None
    if _is_instance(raw, "torch.utils.data", ("IterableDataset",)):
        kind, fix = "a torch IterableDataset", ("return its files as elasticflow.data.Shards(paths) (jsonl, parquet, "
                                                ".npy, .bin, .tar), or a map-style torch Dataset")
    elif _is_instance(raw, "tensorflow", ("data.Dataset",)):
        kind, fix = "a tf.data.Dataset", _tf_data_fix(raw)
    elif _is_instance(raw, "torch.utils.data", ("DataLoader",)):
        kind, fix = "a torch DataLoader", "return its dataset (loader.dataset): ElasticFlow batches and shuffles"
    elif hasattr(raw, "__next__") or (hasattr(raw, "__iter__") and not hasattr(raw, "__getitem__")):
        kind, fix = f"an iterable ({type(raw).__name__})", ("write the samples to shard files and return "
                                                            "elasticflow.data.Shards(paths), or return arrays or an "
                                                            "object with __len__ and __getitem__")
    if kind:
        raise ElasticFlowError(f"{what} returned {kind}, which can only be read in order; {_RANDOM_ACCESS}", fix)


def adapt(raw: Any, what: str, collate: Optional[Callable[[List[Any]], Any]] = None) -> Any:
    """``raw`` as a reader (``len`` and ``read(indices)``), or None for arrays held in memory.

    ``collate``: the model file's ``collate(samples)``, for a map-style source that has none of its own.
    """
    from .hf_streams import from_hugging_face
    from .shards import Shards

    if _is_instance(raw, "datasets", ("IterableDataset",)):  # streaming=True over data files: their shards
        raw = from_hugging_face(raw, what)
    elif getattr(raw, "shard_files", None) is not None and hasattr(raw, "__iter__"):
        raw = Shards(raw.shard_files)  # the stream protocol: an iterable that names the files it reads
    if isinstance(raw, Shards):
        if raw.collate_fn is None:
            raw.collate_fn = collate
        return raw
    if collate is not None:
        if isinstance(raw, Mapped) and raw.collate_fn is None:
            return Mapped(raw.dataset, collate)
        if isinstance(raw, Columns) and raw.collate_fn is None:
            return Columns(raw.dataset, *raw.columns, collate_fn=collate)
    if isinstance(raw, (Mapped, Columns, NpyShards, Mmapped)):
        return raw
    refuse_iterable(raw, what)
    if _is_instance(raw, "datasets", ("Dataset",)):
        return Columns(raw, collate_fn=collate)
    if _is_instance(raw, "torch.utils.data", ("Dataset",)) or (collate and hasattr(raw, "__getitem__")):
        return Mapped(raw, collate)
    return None
