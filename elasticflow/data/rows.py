"""Reading parts of files without mapping them: byte ranges and array rows by ``pread``, through a bounded set of
open file descriptors (a corpus of thousands of shards would otherwise hold one each).
"""
from __future__ import annotations

import contextlib
import itertools
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
    def reading(self, path: str, read_ahead: bool = False) -> Iterator[int]:
        """An open descriptor of PATH for the block; a file opened now (or with ``read_ahead``) is also read
        ahead into the page cache (``_advise``)."""
        with self._lock:
            entry, opened = self._open.get(path), False
            if entry is None:
                entry = self._open[path] = [os.open(path, os.O_RDONLY), 0]
                opened = True
                self._trim()
            self._open.move_to_end(path)
            entry[1] += 1
        try:
            if opened or read_ahead:
                _advise(entry[0])
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
ADVISE_UP_TO = 1 << 30  # bytes: files up to this size are read ahead whole (posix_fadvise WILLNEED)
ADVISE_CHUNK = 4 << 20  # bytes per call (Linux 6.1 here)


def _advise(fd: int) -> None:
    """Ask the kernel to bring the whole file into the page cache, in large requests, in the background.

    Rows are read at random across a window of shards, which the kernel fetches page by page on demand: a cold
    read ran at half the speed of a sequential one. Not a file so large that it would push the rest of the page
    cache out (an array on disk bigger than memory)."""
    if not hasattr(os, "posix_fadvise"):
        return
    size = os.fstat(fd).st_size
    if size <= ADVISE_UP_TO:
        for at in range(0, size, ADVISE_CHUNK):  # one call for the whole file brought in only its first 8 MB
            os.posix_fadvise(fd, at, ADVISE_CHUNK, os.POSIX_FADV_WILLNEED)


def read_ahead(path: str) -> None:
    """Start bringing PATH into the page cache (files opened here are read ahead at first use anyway; this is
    for a file about to be needed: the shards of the next window). Only a hint: a file that cannot be opened
    now is reported when it is read."""
    try:
        with FILES.reading(path, read_ahead=True):
            pass
    except OSError:
        pass


def pread_ranges(path: str, starts: np.ndarray, ends: np.ndarray) -> List[bytes]:
    """The byte ranges [starts[i], ends[i]) of a file, sorted by start; adjacent ranges are read in one call."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if not len(starts):
        return []
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1  # runs of adjacent ranges
    firsts, lasts = np.r_[0, breaks], np.r_[breaks, len(starts)] - 1
    with FILES.reading(path) as fd:  # one pread per run, called from C (map): no Python frame per range
        blobs = list(map(os.pread, itertools.repeat(fd, len(firsts)), (ends[lasts] - starts[firsts]).tolist(),
                         starts[firsts].tolist()))
    if len(blobs) == len(starts):
        return blobs
    out: List[bytes] = []
    s, e = starts.tolist(), ends.tolist()
    for blob, lo, hi in zip(blobs, firsts.tolist(), lasts.tolist()):
        base = s[lo]
        out += [blob[a - base:b - base] for a, b in zip(s[lo:hi + 1], e[lo:hi + 1])]
    return out


class DiskRows:
    """Rows of a memory-mapped array read with ``pread`` into the batch's own buffer.

    Not through the mapping: a fault maps at least a page and, where the page cache holds the file in
    large folios (a file just written), a whole folio, so 40 random batches brought a 2 GiB file
    into the resident set (measured, scripts/bench/bench_data.py). pread leaves the file in the page
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
