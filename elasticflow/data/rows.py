"""Reading parts of files without mapping them: byte ranges and array rows by ``pread``, through a bounded set of
open file descriptors (a corpus of thousands of shards would otherwise hold one each).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from typing import Iterator, List

import numpy as np

from ..errors import ElasticFlowError


class OpenFiles:
    """Read-only descriptors kept open for reuse, at most ``limit`` of them: the least recently used one not
    being read from is closed to make room (never one in use: another thread may be inside its pread)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._open: "OrderedDict[str, List[int]]" = OrderedDict()  # path -> [fd, readers now]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[int]:
        with self._lock:
            entry = self._open.get(path)
            if entry is None:
                entry = self._open[path] = [os.open(path, os.O_RDONLY), 0]
                self._trim()
            self._open.move_to_end(path)
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1

    def _trim(self) -> None:
        for path in list(self._open):
            if len(self._open) <= self.limit:
                return
            fd, readers = self._open[path]
            if not readers:
                os.close(fd)
                del self._open[path]


FILES = OpenFiles()


def pread_ranges(path: str, starts: np.ndarray, ends: np.ndarray) -> List[bytes]:
    """The byte ranges [starts[i], ends[i]) of a file, sorted by start; adjacent ranges are read in one call."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if not len(starts):
        return []
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1  # runs of adjacent ranges
    firsts, lasts = np.r_[0, breaks].tolist(), (np.r_[breaks, len(starts)] - 1).tolist()
    s, e = starts.tolist(), ends.tolist()  # Python ints: numpy scalars cost ~0.1 us per access in the loop
    out: List[bytes] = []
    with FILES.reading(path) as fd:
        for lo, hi in zip(firsts, lasts):
            blob = os.pread(fd, e[hi] - s[lo], s[lo])
            if lo == hi:
                out.append(blob)
            else:
                base = s[lo]
                out += [blob[a - base:b - base] for a, b in zip(s[lo:hi + 1], e[lo:hi + 1])]
    return out


class DiskRows:
    """Rows of a memory-mapped array read with ``pread`` into the batch's own buffer.

    Not through the mapping: a fault maps at least a page and, where the page cache holds the file in
    large folios (a file just written), a whole folio, so 40 random batches brought a 2 GiB file
    into the resident set (measured, scripts/bench_data.py). pread leaves the file in the page
    cache, which the kernel may drop, and maps nothing. Runs of consecutive rows are one call each.
    """

    def __init__(self, array: np.memmap):
        self.array = array  # kept: the mapping stays valid as the fallback and for non-contiguous files
        self.path = None
        if getattr(array, "filename", None) and array.flags.c_contiguous and array.ndim >= 1:
            self.path = array.filename
            self.offset, self.row_bytes = int(array.offset), int(array.strides[0]) if array.ndim > 1 else array.itemsize
        self.shape, self.dtype = array.shape, array.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, indices: np.ndarray) -> np.ndarray:
        order = np.argsort(indices, kind="stable")
        rows = np.empty((len(indices),) + self.shape[1:], dtype=self.dtype)
        wanted = indices[order]
        if self.path is None:
            rows[order] = self.array[wanted]
            return rows
        sorted_rows = np.empty_like(rows)
        flat = sorted_rows.reshape(len(indices), -1).view(np.uint8)
        breaks = np.flatnonzero(np.diff(wanted) != 1) + 1  # runs of consecutive rows
        with FILES.reading(self.path) as fd:
            for lo, hi in zip(np.r_[0, breaks].tolist(), np.r_[breaks, len(wanted)].tolist()):
                view = memoryview(flat[lo:hi]).cast("B")
                got = os.preadv(fd, [view], self.offset + int(wanted[lo]) * self.row_bytes)
                if got != len(view):
                    raise ElasticFlowError(f"{self.path} is shorter than its header says (rows {wanted[lo]}.."
                                           f"{wanted[hi - 1]} read {got} of {len(view)} bytes)",
                                           "the file was truncated or is being rewritten; write it again")
        rows[order] = sorted_rows
        return rows
