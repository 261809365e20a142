"""Host memory whose pages can be given back piece by piece while the tensor over it stays valid.

``trainer.shard=parameters`` keeps the parameters as one flat float32 vector (the model's parameters are views
of it, so autograd, the optimizer's formulas and the checkpoints see one tensor), but a worker holds only its
ranges: the rest of the vector is brought in per unit for forward and backward and given back after
(``replica/param_units.py``). A private anonymous mapping does that without moving the tensor: ``drop`` tells
the kernel (``MADV_DONTNEED``) to take the pages back, and the next touch maps a zeroed page. The address
space stays reserved, the resident set does not.

A GPU has no such pages: its vector (``backends/torch/device_pages.py``) unmaps what is given back, and a touch
there is a fault, so every write into memory that may have been given back is preceded by ``ensure`` (a no-op
here). ``ELASTICFLOW_STRICT_PAGES=1`` makes this vector keep that protocol too: pages given back are
``PROT_NONE`` until ensured, and a touch without ``ensure`` is a segfault, so the CPU suite proves the
protocol the GPU path relies on (``tests/test_shard_params.py`` and ``tests/test_shard_frozen.py`` run strict).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Tuple

import numpy as np
import torch

PAGE = mmap.PAGESIZE
FLOAT = 4  # bytes per float32 element
ENV_STRICT = "ELASTICFLOW_STRICT_PAGES"  # "1": pages given back fault until ensured (what a GPU's do)
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE


def strict_default() -> bool:
    return os.environ.get(ENV_STRICT) == "1"


class PagedVector:
    """A 1-D float32 host tensor of ``n`` elements over its own page-aligned mapping.

    ``tensor`` is the vector; ``alias`` is a second tensor over the same memory with its own version counter:
    writes through it (a gathered unit arriving) do not count as in-place changes of ``tensor``, whose views
    autograd saved in forward and checks in backward.
    """

    def __init__(self, n: int, strict: bool = False):
        self.n = int(n)
        self._map = mmap.mmap(-1, max(PAGE, self.n * FLOAT), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32, count=self.n)
        self.alias = torch.frombuffer(self._map, dtype=torch.float32, count=self.n)
        self._base = self.tensor.data_ptr()
        # strict: which pages are given back (PROT_NONE) now
        self._out = np.zeros(-(-max(PAGE, self.n * FLOAT) // PAGE), dtype=bool) if strict else None

    def pages(self, lo: int, hi: int) -> Tuple[int, int]:
        """The byte span of the whole pages inside elements [lo, hi) (empty where none is whole)."""
        start = -(-lo * FLOAT // PAGE) * PAGE
        end = hi * FLOAT // PAGE * PAGE
        return start, max(start, end)

    def drop(self, lo: int, hi: int) -> int:
        """Give back the whole pages inside elements [lo, hi); their elements read as 0 until written.
        Returns the bytes given back. The partial pages at either end stay (they hold neighbours' elements)."""
        start, end = self.pages(lo, hi)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
            if self._out is not None:
                self._protect(start, end, _PROT_NONE)
                self._out[start // PAGE:end // PAGE] = True
        return end - start

    def ensure(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) writable: here they always are (a page given back reads as zeros until written);
        strict, the pages given back among them are opened again (reading as zeros)."""
        if self._out is None or hi <= lo:
            return
        first, last = lo * FLOAT // PAGE, -(-hi * FLOAT // PAGE)
        if self._out[first:last].any():
            self._protect(first * PAGE, last * PAGE, _PROT_RW)
            self._out[first:last] = False

    def _given_back(self, at: int) -> bool:
        """Whether element ``at``'s page is given back (strict only; else its page reads as zeros anyway)."""
        return self._out is not None and bool(self._out[at * FLOAT // PAGE])

    def _protect(self, start: int, end: int, prot: int) -> None:
        end = min(end, len(self._map))
        if end > start and _libc().mprotect(ctypes.c_void_p(self._base + start), ctypes.c_size_t(end - start),
                                            ctypes.c_int(prot)) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed on a PagedVector")

    def zero(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) set to 0, giving back their whole pages instead of writing them."""
        start, end = self.pages(lo, hi)
        if end <= start:
            if not self._given_back(lo) or not self._given_back(hi - 1):
                self.ensure(lo, hi)
                self.alias[lo:hi].zero_()
            return
        # The partial pages at either end: written, unless given back (they read as zeros already)
        for a, b in ((lo, start // FLOAT), (end // FLOAT, hi)):
            if b > a and not self._given_back(a):
                self.alias[a:b].zero_()
        self.drop(lo, hi)

    def resident_bytes(self) -> int:
        """Bytes of the vector in memory now (``resident_bytes``), for tests and benchmarks."""
        return resident_bytes(self.tensor.data_ptr(), self.n * FLOAT)


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # loaded once: mprotect runs per unit given back and brought in


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the pages from ``address`` (page-aligned) over ``nbytes`` that are in memory now: the present bit of
    each page in /proc/self/pagemap (smaps would count a neighbouring mapping the kernel merged with this one)."""
    first, pages = address // PAGE, -(-nbytes // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read(pages * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * PAGE


LAZY = 1 << 18  # elements (1 MiB): shorter vectors are plain tensors (a mapping each would cost more than it saves)


def zeros(n: int) -> torch.Tensor:
    """``n`` float32 zeros on the host; from ``LAZY`` elements on, their pages are mapped only where written
    (reading the rest maps the kernel's zero page): fresh optimizer slots for a whole vector that a worker keeps
    only slices of (trainer.shard), or that its first update writes anyway."""
    if n < LAZY:
        return torch.zeros(n, dtype=torch.float32)
    return PagedVector(n).tensor  # the tensor keeps the mapping alive
