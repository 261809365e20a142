"""Sums whose bits depend on neither the order nor the grouping of their terms (``trainer.reproducible``).

A float32 sum rounds after every addition, so ``(g0 + g1) + (g2 + g3)`` (two workers) and
``((g0 + g1) + g2) + g3`` (one) differ in the last bits, and a long run amplifies them. Here each element's
sum is a fixed-point number held in two int64 *bins*, which add exactly in any order: an indexed sum in the
manner of Demmel and Nguyen's reproducible summation (ReproBLAS), with two bins and integers for carries.

- Exponents are cut into absolute bins of ``W`` = 31 bits; an element's *window* is the bin of the leading
  bit of the largest term it has seen. Its ``hi`` bin counts units of ``2^(window W)``, its ``lo`` bin units
  of ``2^((window - 1) W)``; a term's bits below ``lo`` are dropped (truncated), the same bits whoever adds it.
- A larger term raises the window: ``hi`` becomes ``lo`` and the old ``lo`` is dropped (all of it: its bits
  lie below the new window for every term). So the final value is a function of the set of terms alone:
  the sum, over the terms, of their bits in the window of the largest one.
- Members agree on the window first (a MAX of one int8 per element), move their bins to it, then sum the
  bins (int64 SUM, exact: each bin adds terms below ``2^31``, so ``2^31`` terms fit).
- The result keeps at least 31 bits below the largest term's leading bit, where a float32 sum keeps 24
  below the running sum's: never less accurate than float32 accumulation (``docs/exactness.md``).
- A NaN or infinite term marks the element non-finite (window ``NONFINITE``, which the MAX spreads); its
  sum is NaN, so the non-finite check of the step still sees it.

Costs: 17 bytes per element (two int64 bins, the int8 window) where a float32 sum has 4, and about twenty
elementwise operations per term vector (``scripts/bench_exact.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

W = 31                 # bits per bin: a term's two bins hold < 2^62, and 2^31 terms sum without overflow
MIN_WINDOW = -30       # below 2^-930 terms lose their bits (float32's smallest is 2^-149)
MAX_WINDOW = 33        # float64's largest finite values
NONFINITE = 127        # an element some term of which was NaN or infinite
_MASK = (1 << W) - 1


def _powers(shift: int, device: Any, sign: int = 1) -> torch.Tensor:
    """``2^(sign (w + shift) W)`` for each window w from MIN_WINDOW to MAX_WINDOW, exactly (float64)."""
    return torch.tensor([2.0 ** (sign * (w + shift) * W) for w in range(MIN_WINDOW, MAX_WINDOW + 1)],
                        dtype=torch.float64, device=device)


class ExactSum:
    """Exact sums of ``n`` elements: ``add`` terms in any order and grouping, ``allreduce`` across members,
    ``values`` reads the sums. The same terms give the same bits.

    Example:
        >>> acc = ExactSum(3)
        >>> acc.add(torch.tensor([1e8, 1.0, -2.5])); acc.add(torch.tensor([-1e8, 1e-8, 2.5]))
        >>> acc.values()  # tensor([0.0000e+00, 1.0000e+00, 0.0000e+00], dtype=torch.float64)
    """

    def __init__(self, n: int, device: Any = "cpu"):
        self.bins = torch.zeros(2, n, dtype=torch.int64, device=device)  # hi, lo: one tensor, one collective
        self.window = torch.full((n,), MIN_WINDOW, dtype=torch.int8, device=device)
        self._down = _powers(-1, device, -1)  # a term times this counts units of its lo bin
        self._hi_unit, self._lo_unit = _powers(0, device), _powers(-1, device)

    @property
    def n(self) -> int:
        return self.window.numel()

    def clear(self) -> None:
        self.bins.zero_()
        self.window.fill_(MIN_WINDOW)

    def add(self, terms: Any, at: int = 0) -> None:
        """Add ``terms`` (a tensor or array of any float dtype, flattened) to elements ``at .. at + len``."""
        v = torch.as_tensor(terms).detach().reshape(-1).to(self.window.device, torch.float64)
        end = at + v.numel()
        finite = torch.isfinite(v)
        mag = torch.where(finite, v.abs(), 0.0)
        _, exponent = torch.frexp(mag)  # mag in [2^(e-1), 2^e)
        window = torch.div(exponent - 1, W, rounding_mode="floor").clamp_(MIN_WINDOW, MAX_WINDOW)
        window = torch.where(mag > 0, window, MIN_WINDOW)
        window = torch.where(finite, window, NONFINITE)
        window = torch.maximum(window, self.window[at:end].to(window.dtype))
        self._move(window, at, end)
        units = torch.trunc(mag * self._down[(window - MIN_WINDOW).clamp_(max=MAX_WINDOW - MIN_WINDOW).long()])
        units = units.to(torch.int64)  # exact: < 2^62
        # Sign and magnitude, both bins: a term's hi is then exactly its lo one window up (what _move relies on)
        hi, lo = units >> W, units & _MASK
        negative = v < 0
        self.bins[0, at:end] += torch.where(negative, -hi, hi)
        self.bins[1, at:end] += torch.where(negative, -lo, lo)

    def _move(self, window: torch.Tensor, at: int, end: int) -> None:
        """Raise elements ``at .. end``'s windows to ``window``: hi becomes lo a bin up, and what fell below goes."""
        raised = window.to(torch.int64) - self.window[at:end].to(torch.int64)
        hi, lo = self.bins[0, at:end], self.bins[1, at:end]
        lo.copy_(torch.where(raised == 0, lo, torch.where(raised == 1, hi, 0)))
        hi.masked_fill_(raised != 0, 0)
        self.window[at:end] = window.to(torch.int8)

    def allreduce(self, group: Any) -> None:
        """Sum the members' bins in place (every member calls it, in the same order as its other collectives):
        a MAX of the windows, then an int64 SUM of the bins. ``group``: a ``distributed.comm.Group``."""
        window = self.window.clone()
        group.allreduce_(window, op="max")
        self._move(window, 0, self.n)
        group.allreduce_(self.bins)

    def values(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sums, float64 (or rounded once more into ``out``'s dtype). NaN where a term was not finite."""
        index = (self.window.long() - MIN_WINDOW).clamp_(0, MAX_WINDOW - MIN_WINDOW)
        # Each product is exact (bins below 2^53); their sum rounds once.
        result = self.bins[0].double() * self._hi_unit[index] + self.bins[1].double() * self._lo_unit[index]
        result.masked_fill_(self.window == NONFINITE, float("nan"))
        if out is not None:
            out.copy_(result.view(out.shape))
            return out
        return result
