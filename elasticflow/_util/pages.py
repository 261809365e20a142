"""Host memory whose pages can be given back piece by piece while the tensor over it stays valid.

``trainer.shard=parameters`` keeps the parameters as one flat float32 vector (the model's parameters are views
of it, so autograd, the optimizer's formulas and the checkpoints see one tensor), but a worker holds only its
ranges: the rest of the vector is brought in per unit for forward and backward and given back after
(``replica/param_units.py``). A private anonymous mapping does that without moving the tensor: ``drop`` tells
the kernel (``MADV_DONTNEED``) to take the pages back, and the next touch maps a zeroed page. The address
space stays reserved, the resident set does not.
"""
from __future__ import annotations

import mmap
from typing import Tuple

import numpy as np
import torch

PAGE = mmap.PAGESIZE
FLOAT = 4  # bytes per float32 element


class PagedVector:
    """A 1-D float32 host tensor of ``n`` elements over its own page-aligned mapping.

    ``tensor`` is the vector; ``alias`` is a second tensor over the same memory with its own version counter:
    writes through it (a gathered unit arriving) do not count as in-place changes of ``tensor``, whose views
    autograd saved in forward and checks in backward.
    """

    def __init__(self, n: int):
        self.n = int(n)
        self._map = mmap.mmap(-1, max(PAGE, self.n * FLOAT), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32, count=self.n)
        self.alias = torch.frombuffer(self._map, dtype=torch.float32, count=self.n)

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
        return end - start

    def zero(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) set to 0, giving back their whole pages instead of writing them."""
        start, end = self.pages(lo, hi)
        if end <= start:
            self.alias[lo:hi].zero_()
            return
        self.alias[lo:start // FLOAT].zero_()  # the partial pages at either end: written
        self.alias[end // FLOAT:hi].zero_()
        self.drop(lo, hi)

    def resident_bytes(self) -> int:
        """Bytes of the vector in memory now (``resident_bytes``), for tests and benchmarks."""
        return resident_bytes(self.tensor.data_ptr(), self.n * FLOAT)


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
