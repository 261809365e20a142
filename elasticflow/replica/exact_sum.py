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

Costs: 17 bytes per element (two int64 bins, the int8 window) where a float32 sum has 4, and a pass over them
per term vector, compiled into one loop for a large gradient (``scripts/bench_exact.py``).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("elasticflow")

W = 31                 # bits per bin: a term's two bins hold < 2^62, and 2^31 terms sum without overflow
MIN_WINDOW = -30       # below 2^-930 terms lose their bits (float32's smallest is 2^-149)
MAX_WINDOW = 33        # float64's largest finite values
NONFINITE = 100        # the window of an element some term of which was NaN or infinite (above any real one)
_MASK = (1 << W) - 1


def _per_lo_unit(device: Any) -> torch.Tensor:
    """``2^(-(w - 1) W)`` for each window w from MIN_WINDOW to MAX_WINDOW, exactly (float64): a term times it
    counts units of its lo bin."""
    return torch.tensor([2.0 ** (-(w - 1) * W) for w in range(MIN_WINDOW, MAX_WINDOW + 1)],
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
        self._down = _per_lo_unit(device)  # _add_any's scale

    @property
    def n(self) -> int:
        return self.window.numel()

    def clear(self) -> None:
        self.bins.zero_()
        self.window.fill_(MIN_WINDOW)

    def add(self, terms: Any, at: int = 0) -> None:
        """Add ``terms`` (a tensor or array of any float dtype, flattened) to elements ``at .. at + len``."""
        t = torch.as_tensor(terms).detach().reshape(-1)
        if t.dtype == torch.float32 and t.device == self.window.device:
            self._add_float32(t, at)
        else:
            self._add_any(t.to(self.window.device, torch.float64).reshape(1, -1), at)

    def _add_float32(self, t: torch.Tensor, at: int) -> None:
        """``add`` for float32 terms (a gradient): ``deposit_float32``, compiled into one loop for a large gradient."""
        end = at + t.numel()
        _run(deposit_float32_, (t, self.window[at:end], self.bins[0, at:end], self.bins[1, at:end]))

    def add_rows(self, rows: Any, at: int = 0) -> None:
        """Add each row of ``rows`` (an m x k array: m terms for each of elements ``at .. at + k``), as m calls of
        ``add`` would, in one: the same bins (each is the sum of its terms' bits in the final window)."""
        v = torch.as_tensor(rows).detach().to(self.window.device, torch.float64)
        if v.numel():
            self._add_any(v.reshape(v.shape[0], -1), at)

    def _add_any(self, v: torch.Tensor, at: int) -> None:
        """``add`` for any other terms (float64 scalars, buffer contributions: short vectors), through float64;
        ``v``: rows of terms (m x k), all at once at the largest window."""
        end = at + v.shape[-1]
        finite = torch.isfinite(v)
        mag = torch.where(finite, v.abs(), 0.0)
        _, exponent = torch.frexp(mag)  # mag in [2^(e-1), 2^e)
        window = torch.div(exponent - 1, W, rounding_mode="floor").clamp_(MIN_WINDOW, MAX_WINDOW)
        window = torch.where(mag > 0, window, MIN_WINDOW)
        window = torch.where(finite, window, NONFINITE).amax(0)
        window = torch.maximum(window, self.window[at:end].to(window.dtype))
        self._move(window, at, end)
        units = torch.trunc(mag * self._down[(window - MIN_WINDOW).clamp_(max=MAX_WINDOW - MIN_WINDOW).long()])
        units = units.to(torch.int64)  # exact: < 2^62
        # Sign and magnitude, both bins: a term's hi is then exactly its lo one window up (what _move relies on)
        hi, lo = units >> W, units & _MASK
        negative = v < 0
        self.bins[0, at:end] += torch.where(negative, -hi, hi).sum(0)
        self.bins[1, at:end] += torch.where(negative, -lo, lo).sum(0)

    def _move(self, window: torch.Tensor, at: int, end: int) -> None:
        """Raise elements ``at .. end``'s windows to ``window`` (``moved``)."""
        self.window[at:end], self.bins[0, at:end], self.bins[1, at:end] = moved(
            window, self.window[at:end], self.bins[0, at:end], self.bins[1, at:end])

    def allreduce(self, group: Any) -> None:
        """Sum the members' bins in place (every member calls it, in the same order as its other collectives):
        a MAX of the windows, then an int64 SUM of the bins. ``group``: a ``distributed.comm.Group``."""
        window = self.window.clone()
        group.allreduce_(window, op="max")
        self._move(window, 0, self.n)
        group.allreduce_(self.bins)

    def values(self) -> torch.Tensor:
        """The sums, float64. NaN where a term was not finite."""
        return _run(sums_float64, (self.window, self.bins[0], self.bins[1]))


SQUARES_BLOCK = 1 << 20  # elements whose squares go into the sum at a time (their float64 temporaries: ~40 MiB)


def sum_squares_exactly(t: torch.Tensor) -> ExactSum:
    """The sum of the squares of ``t``'s elements, exact, in an ``ExactSum`` of one element (``values()[0]``; its
    ``allreduce`` adds the members'): gradient clipping's norm under ``trainer.reproducible``, the same bits however
    the vector is cut among members. Each square of a float32 is exact in float64 (48 bits of mantissa)."""
    acc = ExactSum(1, t.device)
    flat = t.detach().reshape(-1)
    for lo in range(0, flat.numel(), SQUARES_BLOCK):
        acc.add_rows(flat[lo:lo + SQUARES_BLOCK].to(torch.float64).square_().reshape(-1, 1))
    return acc


def moved(window: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor):
    """Bins ``hi``, ``lo`` at windows ``held`` raised to ``window`` (>= held): up one window, hi becomes lo and the
    old lo goes; up two or more, both go. Returns (window as int8, hi, lo). In multiplications by 0 or 1, not
    ``torch.where``: a where on a random mask costs as much as ten of them (mispredicted branches)."""
    raised = window.to(torch.int64) - held.to(torch.int64)
    same, up_one = (raised == 0).to(torch.int64), (raised == 1).to(torch.int64)
    return window.to(torch.int8), hi * same, lo * same + hi * up_one


def deposit_float32(t: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor):
    """Float32 terms ``t`` added to bins ``hi``, ``lo`` at windows ``held``: returns the new (window, hi, lo).

    From the terms' bits, in integer operations without a branch, so that eager torch and one compiled loop
    (``_compiled``) give the same bits. The same sums as ``ExactSum._add_any``: a float32 zero's window is
    float32's lowest, -5, where ``_add_any`` gives MIN_WINDOW (no float32 term has bits below either)."""
    bits = t.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    # The leading bit's position is biased - 127 (subnormals too: all in bin -5); floor((biased - 127) / 31) by a
    # multiply and a shift, exact for 0 <= biased + 28 < 400. A NaN or infinity (biased 255, bin 4) lands at NONFINITE.
    own = (((biased + 28) * 2115) >> 16) - 5 + (biased == 0xFF).to(torch.int32) * (NONFINITE - 4)
    window = torch.maximum(own, held.to(torch.int32))
    window8, hi, lo = moved(window, held, hi, lo)
    normal = (biased != 0).to(torch.int32)
    mantissa = ((bits & 0x7FFFFF) | (normal << 23)).to(torch.int64)
    # Units of the lo bin, 2^(31 (window - 1)): mantissa * 2^(exponent - 150 - 31 (window - 1)), truncated: a left
    # shift by 39 (mantissa < 2^24: below 2^63) and a right shift by the rest (from 0; 63 at most: C's >> is
    # undefined from 64 on, and a compiled loop is C)
    shift = (158 - 1 + normal - biased + W * window).clamp(max=63)
    units = (mantissa << 39) >> shift.to(torch.int64)
    sign = (bits >> 31).to(torch.int64)  # 0 or -1: x ^ sign - sign is x or -x
    return window8, hi + (((units >> W) ^ sign) - sign), lo + (((units & _MASK) ^ sign) - sign)


def deposit_float32_(t: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``deposit_float32`` written back into ``held``, ``hi``, ``lo``: compiled, one loop that reads and writes
    each element's 17 bytes once (returned and then copied, 3x the time on 2.2M elements)."""
    window, new_hi, new_lo = deposit_float32(t, held, hi, lo)
    held.copy_(window)
    hi.copy_(new_hi)
    lo.copy_(new_lo)


def sums_float64(window: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The value of bins ``hi``, ``lo`` at ``window``: (hi 2^31 + lo), rounded once to float64, times the lo bin's
    unit 2^(31 (window - 1)), made from its exponent bits (exact: a power of two). NaN where not finite."""
    unit = ((W * (window.to(torch.int64).clamp(MIN_WINDOW, MAX_WINDOW) - 1) + 1023) << 52).view(torch.float64)
    value = (hi.to(torch.float64) * float(1 << W) + lo.to(torch.float64)) * unit
    return torch.where(window >= NONFINITE, float("nan"), value)  # a mask seldom true: no mispredictions


# Elements from which deposit_float32 and sums_float64 run compiled by torch.compile (inductor: one C++ loop on a
# CPU, a Triton kernel on a GPU; ~20x faster than eager on a CPU; the first call compiles, ~20 s), else eager:
# the same integer and power-of-two arithmetic, the same bits.
COMPILE_FROM = 1 << 18
_compiled: dict = {}  # function -> compiled, or False where compiling failed


def _run(fn: Any, args: tuple) -> Any:
    """``fn(*args)``, compiled where the first argument is large."""
    kernel = _compiled.get(fn)
    if args[0].numel() < COMPILE_FROM or kernel is False:
        return fn(*args)
    try:
        if kernel is None:
            kernel = _compiled[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
        return kernel(*args)
    except Exception as exc:  # noqa: BLE001 - no C++ compiler, say: the eager path gives the same bits
        log.warning("exact sums run eager, slower (torch.compile failed: %s)", str(exc).splitlines()[0][:200])
        _compiled[fn] = False
        return fn(*args)
