"""One shard file of a sharded corpus, read at any row: jsonl, parquet, ``.npy`` rows or tokens, raw ``.bin`` tokens,
WebDataset ``.tar``. Each format builds a small index once (``index(path)``: arrays, cached by ``shards.py``) and
reads the rows asked for with ``pread`` or the format's own random access, never the whole file. An index array
with a row per sample comes back as ``rows.DiskRows`` (read by ``pread`` too): memory does not grow with the corpus.

Samples: a jsonl line is its parsed object; a parquet row is ``{column: value}``; a ``.npy`` row or a token window
is an array; a WebDataset sample is ``{extension: bytes}`` with its ``__key__``.
"""
from __future__ import annotations

import json
import os
import re
import tarfile
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import ElasticFlowError
from .rows import DiskRows, pread_ranges, read_ahead

CHUNK = 8 << 20  # bytes scanned at a time while indexing a jsonl file


class Shard:
    """Base: ``len()`` rows, ``read(rows)`` for sorted row numbers (a list of samples in that order)."""

    def __init__(self, path: str, index: Dict[str, np.ndarray]):
        self.path, self.index = path, index

    def __len__(self) -> int:
        return int(self.index["rows"][0])

    def read(self, rows: np.ndarray) -> List[Any]:
        raise NotImplementedError

    @staticmethod
    def fits(index: Dict[str, Any], rows: int, size: int) -> bool:
        """Whether INDEX (read back from the cache, of ROWS rows) can describe a file of SIZE bytes."""
        raise NotImplementedError

    def read_ahead(self) -> None:
        """Start bringing the file into the page cache (its window is next)."""
        read_ahead(self.path)


class LoadedIndexes:
    """On-disk index arrays read whole once a shard is read from often: the ``limit`` used last (a window's
    worth and more), so memory is bounded by the window, not the corpus. Until a shard's rows read reach
    1/``WHOLE_AFTER`` of its rows they are read one by one (a shard a worker only glances at, as when few of
    its batches fall in it, costs its rows' entries, not the whole array); after that, one read for the rest."""

    WHOLE_AFTER = 16

    def __init__(self, limit: int = 16):
        self.limit, self._arrays = limit, OrderedDict()
        self._rows_read: Dict[tuple, int] = {}
        self._lock = threading.Lock()

    def take(self, array: DiskRows, rows: np.ndarray) -> np.ndarray:
        key = (array.path, array.offset)
        with self._lock:
            if key in self._arrays:
                self._arrays.move_to_end(key)
                return self._arrays[key][rows]
            self._rows_read[key] = seen = self._rows_read.get(key, 0) + len(rows)
        if seen * self.WHOLE_AFTER < len(array):
            return array.read(rows)
        whole = array.read(np.arange(len(array)))
        with self._lock:
            self._arrays[key] = whole
            self._rows_read.pop(key, None)
            while len(self._arrays) > self.limit:
                self._arrays.popitem(last=False)
        return whole[rows]


LOADED = LoadedIndexes()


def take(array: Any, rows: np.ndarray) -> np.ndarray:
    """``array[rows]`` of an index array held in memory or on disk (``DiskRows``: see ``LoadedIndexes``)."""
    return LOADED.take(array, rows) if isinstance(array, DiskRows) else array[rows]


class Jsonl(Shard):
    """One JSON object per line; the index holds each line's start offset (and the end)."""

    @staticmethod
    def index(path: str, **_: Any) -> Dict[str, np.ndarray]:
        newlines, size = [], 0
        with open(path, "rb") as f:
            while True:
                block = f.read(CHUNK)
                if not block:
                    break
                newlines.append(np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + size)
                size += len(block)
        ends = np.concatenate(newlines + [np.asarray([size], np.int64)]).astype(np.int64)  # a last line may lack "\n"
        starts = np.r_[0, ends[:-1] + 1]
        spans = np.stack([starts, ends], axis=1)[ends > starts]  # empty lines are no samples
        return {"rows": np.asarray([len(spans)]), "spans": spans}

    @staticmethod
    def fits(index: Dict[str, Any], rows: int, size: int) -> bool:
        spans = index.get("spans")
        return _table(spans, rows, 2) and _inside(spans, size)

    def read(self, rows: np.ndarray) -> List[Any]:
        spans = take(self.index["spans"], rows)
        lines = pread_ranges(self.path, spans[:, 0], spans[:, 1] + 1)  # with the "\n": adjacent lines join
        try:
            return parse_lines(lines)
        except (ValueError, StopIteration):  # a line that is not JSON (or not UTF-8): json.loads names it
            return [self._parse(int(row), line) for row, line in zip(rows, lines)]

    def _parse(self, row: int, line: bytes) -> Any:
        try:
            return json.loads(line)
        except ValueError as exc:
            raise ElasticFlowError(f"{self.path}: line {row + 1} (counting non-empty lines) is not JSON ({exc})",
                                   "fix the line (its index is rebuilt when the file changes)") from None


_SCAN = json.JSONDecoder().scan_once  # json.loads's own C scanner, without its per-call checks
_BLANKS = re.compile(r"[ \t\r]*").match  # JSON's whitespace but the newline that ends a line


def parse_lines(lines: List[bytes]) -> List[Any]:
    """``[json.loads(line) for line in lines]`` for lines that each end in one newline (the last may lack it),
    decoded as one string: 1.1-1.3x faster, which is most of what reading at random costs over a sequential
    pass (scripts/bench/bench_data.py --only shards). Each value must end its line and every line must hold one:
    anything else raises (ValueError or StopIteration) and the caller parses line by line to name it."""
    text = b"".join(lines).decode()
    out, at, size, ends_line = [], 0, len(text), text.startswith
    for _ in range(len(lines)):
        try:
            value, end = _SCAN(text, at)
        except StopIteration:  # blanks first (or no value: raised again)
            value, end = _SCAN(text, _BLANKS(text, at).end())
        if not ends_line("\n", end):  # blanks after it, or the last line without its newline
            end = _BLANKS(text, end).end()
            if end < size and text[end] != "\n":
                raise ValueError(f"more after a value at character {end}")
        out.append(value)
        at = end + 1
    if at < size:
        raise ValueError("fewer values than lines")
    return out


class Tokens(Shard):
    """A flat array of token ids (``.npy`` 1-D, or raw ``.bin`` as nanoGPT writes them) cut into windows of
    ``seq_len`` tokens, or a 2-D ``.npy`` whose rows are the samples. Read with ``pread`` into the batch."""

    @staticmethod
    def index(path: str, seq_len: Optional[int] = None, dtype: Optional[str] = None, **_: Any) -> Dict[str, np.ndarray]:
        offset, shape, kind = _layout(path, dtype)
        if len(shape) == 1:
            if not seq_len:
                raise ElasticFlowError(f"{path} holds a flat array of {shape[0]} tokens",
                                       "pass seq_len= to Shards() to cut it into samples of that many tokens")
            shape = (shape[0] // seq_len, seq_len)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(kind).itemsize
        return {"rows": np.asarray([shape[0]]), "layout": np.asarray([offset, row_bytes]),
                "shape": np.asarray(shape[1:], dtype=np.int64), "dtype": np.asarray(np.dtype(kind).str)}

    @staticmethod
    def fits(index: Dict[str, Any], rows: int, size: int) -> bool:
        layout, shape, dtype = index.get("layout"), index.get("shape"), index.get("dtype")
        if not (_ints(layout, (2,)) and _ints(shape) and shape.ndim == 1 and (shape >= 0).all()
                and isinstance(dtype, np.ndarray) and dtype.dtype.kind == "U" and dtype.shape == ()):
            return False
        try:
            kind = np.dtype(str(dtype))
        except TypeError:
            return False
        offset, row_bytes = (int(v) for v in layout)
        return (not kind.hasobject and row_bytes == int(np.prod(shape, dtype=np.int64)) * kind.itemsize
                and offset >= 0 and offset + rows * row_bytes <= size)

    def read(self, rows: np.ndarray) -> List[Any]:
        offset, row_bytes = (int(v) for v in self.index["layout"])
        dtype, shape = np.dtype(str(self.index["dtype"])), tuple(int(d) for d in self.index["shape"])
        blobs = pread_ranges(self.path, offset + rows * row_bytes, offset + (rows + 1) * row_bytes)
        return [np.frombuffer(b, dtype).reshape(shape) for b in blobs]


def _layout(path: str, dtype: Optional[str]):
    """(data offset, shape, dtype) of a ``.npy`` file from its header, or of a raw ``.bin`` (dtype given)."""
    if path.endswith(".npy"):
        mapped = np.load(path, mmap_mode="r")  # reads the header only
        if not mapped.flags.c_contiguous:
            raise ElasticFlowError(f"{path} is stored in Fortran order", "save it with np.save (C order)")
        return int(mapped.offset), mapped.shape, mapped.dtype
    kind = np.dtype(dtype or "uint16")  # nanoGPT's .bin: uint16 token ids
    return 0, (os.path.getsize(path) // kind.itemsize,), kind


class Parquet(Shard):
    """Rows of a parquet file, read by row group (the file's unit of compression); the decoded groups this
    process reads are kept in a small LRU, so a window's rows cost one decode per group."""

    _cache: "OrderedDict[tuple, Any]" = OrderedDict()
    _lock = threading.Lock()
    CACHED_GROUPS = 16

    @staticmethod
    def index(path: str, **_: Any) -> Dict[str, np.ndarray]:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        groups = np.asarray([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], dtype=np.int64)
        return {"rows": np.asarray([int(groups.sum())]), "groups": np.cumsum(np.r_[0, groups])}

    @staticmethod
    def fits(index: Dict[str, Any], rows: int, size: int) -> bool:
        groups = index.get("groups")  # the row groups themselves pyarrow checks as it reads them
        return (_ints(groups) and groups.ndim == 1 and len(groups) >= 1 and int(groups[0]) == 0
                and int(groups[-1]) == rows and bool((np.diff(groups) >= 0).all()))

    def read(self, rows: np.ndarray) -> List[Any]:
        starts = self.index["groups"]
        which = np.searchsorted(starts, rows, side="right") - 1
        samples: List[Any] = []
        for g in np.unique(which):
            table = self._group(int(g))
            samples += table.take(rows[which == g] - starts[g]).to_pylist()
        return samples

    def _group(self, g: int) -> Any:
        key = (self.path, g)
        with Parquet._lock:
            if key in Parquet._cache:
                Parquet._cache.move_to_end(key)
                return Parquet._cache[key]
        import pyarrow.parquet as pq

        table = pq.ParquetFile(self.path).read_row_group(g)
        with Parquet._lock:
            Parquet._cache[key] = table
            while len(Parquet._cache) > Parquet.CACHED_GROUPS:
                Parquet._cache.popitem(last=False)
        return table


class WebDataset(Shard):
    """A WebDataset ``.tar``: consecutive members sharing a key (``0001.jpg``, ``0001.cls``) are one sample,
    ``{"__key__": key, "jpg": bytes, "cls": bytes}``. The index holds each member's data offset and size."""

    @staticmethod
    def index(path: str, **_: Any) -> Dict[str, np.ndarray]:
        keys, members = [], []  # members: (sample, offset, size, extension)
        with tarfile.open(path, "r:") as tar:
            for info in tar:  # reads the headers only: data is skipped by seeking
                if not info.isfile():
                    continue
                base = os.path.basename(info.name)
                key, _, ext = base.partition(".")
                key = os.path.join(os.path.dirname(info.name), key)
                if not keys or keys[-1] != key:
                    keys.append(key)
                members.append((len(keys) - 1, info.offset_data, info.size, ext))
        exts = sorted({m[3] for m in members})
        table = np.asarray([(s, o, n, exts.index(e)) for s, o, n, e in members], dtype=np.int64).reshape(-1, 4)
        first = np.searchsorted(table[:, 0], np.arange(len(keys) + 1))  # each sample's first member
        return {"rows": np.asarray([len(keys)]), "members": table, "first": first[:, None],
                "keys": np.asarray(keys, dtype=str)[:, None], "exts": np.asarray(exts, dtype=str)}

    @staticmethod
    def fits(index: Dict[str, Any], rows: int, size: int) -> bool:
        members, first, keys, exts = (index.get(k) for k in ("members", "first", "keys", "exts"))
        if not (_table(first, rows + 1, 1) and _table(members, None, 4) and getattr(keys, "shape", None) == (rows, 1)
                and isinstance(exts, np.ndarray) and exts.ndim == 1):
            return False
        ends = _ends(first)[:, 0]
        if int(ends[0]) != 0 or int(ends[-1]) != len(members):
            return False
        if isinstance(first, np.ndarray) and (np.diff(first[:, 0]) < 0).any():
            return False
        if isinstance(members, DiskRows):  # on disk: its first and last members only (reading it all costs)
            members = _ends(members)
        offsets, sizes = members[:, 1], members[:, 2]
        return bool(((offsets >= 0) & (sizes >= 0) & (offsets + sizes <= size)
                     & (members[:, 3] >= 0) & (members[:, 3] < len(exts))).all())

    def read(self, rows: np.ndarray) -> List[Any]:
        first = take(self.index["first"], np.r_[rows, rows + 1])[:, 0]
        lo, hi = first[:len(rows)], first[len(rows):]
        picked = take(self.index["members"], np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]))
        blobs = pread_ranges(self.path, picked[:, 1], picked[:, 1] + picked[:, 2])
        keys, exts = take(self.index["keys"], rows)[:, 0], self.index["exts"]
        by_row: Dict[int, Dict[str, Any]] = {int(r): {"__key__": str(k)} for r, k in zip(rows, keys)}
        for (row, _, _, ext), blob in zip(picked.tolist(), blobs):
            by_row[row][str(exts[ext])] = blob
        return [by_row[int(r)] for r in rows]


def fits(kind: type, index: Dict[str, Any], size: int) -> bool:
    """Whether INDEX, as read back from the cache, can be KIND's index of a file of SIZE bytes: its row count and
    every array's shape, and the offsets it holds inside the file (all of an array held in memory; the first and
    last rows of one on disk, whose reading is what keeps memory bounded)."""
    rows = index.get("rows")
    return _ints(rows, (1,)) and int(rows[0]) >= 0 and kind.fits(index, int(rows[0]), size)


def _ints(array: Any, shape: Optional[tuple] = None) -> bool:
    return (isinstance(array, (np.ndarray, DiskRows)) and np.issubdtype(array.dtype, np.integer)
            and (shape is None or tuple(array.shape) == shape))


def _table(array: Any, rows: Optional[int], columns: int) -> bool:
    """An integer array of ROWS (any, for None) rows and COLUMNS columns."""
    return (_ints(array) and len(array.shape) == 2 and array.shape[1] == columns
            and (rows is None or array.shape[0] == rows))


def _ends(array: Any) -> np.ndarray:
    """The first and last rows of a non-empty 2-D index array, in memory or on disk."""
    at = np.asarray([0, len(array) - 1])
    return array.read(at) if isinstance(array, DiskRows) else array[at]


def _inside(spans: Any, size: int) -> bool:
    """Whether each line's [start, end] lies inside a file of SIZE bytes, the lines in order (every line of an
    array in memory; the first and last of one on disk)."""
    if not len(spans):
        return True
    rows = _ends(spans) if isinstance(spans, DiskRows) else spans
    starts, ends = rows[:, 0], rows[:, 1]
    return bool((starts >= 0).all() and (starts <= ends).all() and (ends <= size).all()
                and (np.diff(starts) >= 0).all())


FORMATS = {".jsonl": Jsonl, ".json": Jsonl, ".parquet": Parquet, ".npy": Tokens, ".bin": Tokens, ".tar": WebDataset}


def format_of(path: str) -> type:
    for suffix, kind in FORMATS.items():
        if path.endswith(suffix):
            return kind
    raise ElasticFlowError(f"{path}: no shard format for this file name",
                           f"shards are {', '.join(FORMATS)} files (by their suffix)")
