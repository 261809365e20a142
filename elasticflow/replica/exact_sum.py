"""Sums whose bits depend on neither the order nor the grouping of their terms (``trainer.reproducible``).

A float32 sum rounds after every addition, so ``(g0 + g1) + (g2 + g3)`` (two workers) and
``((g0 + g1) + g2) + g3`` (one) differ in the last bits, and a long run amplifies them. Here each element's
sum is a fixed-point number held in two int64 *bins*, which add exactly in any order: an indexed sum in the
manner of Demmel and Nguyen's reproducible summation (ReproBLAS), with two bins and integers for carries.
It is reproducible, not exact: each term is truncated to the element's window first (``docs/exactness.md``).

- Exponents are cut into absolute bins of ``W`` = 26 bits; an element's *window* is the bin of the leading
  bit of the largest term it has seen. Its ``hi`` bin counts units of ``2^(window W)``, its ``lo`` bin units
  of ``2^((window - 1) W)``; a term's bits below ``lo`` are dropped (truncated), the same bits whoever adds it.
- A larger term raises the window: ``hi`` becomes ``lo`` and the old ``lo`` is dropped (all of it: its bits
  lie below the new window for every term). So the final value is a function of the set of terms alone:
  the sum, over the terms, of their bits in the window of the largest one.
- Members agree on the window first (a MAX of one int8 per element), move their bins to it, then sum them
  (int64 SUM: each term adds less than ``2^26`` to a bin, so ``MAX_TERMS`` terms in all, over every member,
  fit; more are refused before a bin can wrap). Each term is less than ``2^52`` units of ``lo``, so while the
  whole sum has at most ``ONE_INT64_TERMS`` (2^11) terms, a member's two bins travel as one int64,
  ``hi 2^26 + lo``: 9 bytes per element on the wire (the window and the sum), 17 beyond that.
- The value is ``hi 2^26 + lo`` in float64 arithmetic (one rounding: an integer below 2^63), then (by the
  caller) rounded to float32: twice, not once.
- Error: a term loses less than one unit of ``lo``, which is at most ``2^-26`` of the largest term, so T terms
  are off by less than ``T 2^-26 max|term|`` before the final rounding. That bound is below float32
  accumulation's worst case (``(T - 1) 2^-24 sum|term|``), but it is a bound, not a promise per case:
  ``[1, -1, 2^-32]`` sums to 0.0 here and to ``2^-32`` in float32.
- A NaN or infinite term marks the element non-finite (window ``NONFINITE``, which the MAX spreads); its
  sum is NaN, so the non-finite check of the step still sees it.

The squared norm (gradient clipping's) has its own accumulator, ``SquaresSum``: exact, rounded once.

Costs: 9 bytes per element on the wire (the int8 window's MAX, then one int64 SUM) where a float32 sum has 4;
locally two int64 bins and the window (17 bytes) and a pass over them per term vector: on a CPU, loops compiled
ahead of time for a large gradient, built once per machine in a background process while the first steps run
eager (``sum_kernels.py``); ``scripts/bench/bench_exact.py``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..errors import ElasticFlowError
from .sum_kernels import (_MASK, MAX_WINDOW, MIN_WINDOW, NONFINITE, W, combined_at_, combined_float32_,
                          combined_float64, deposit4_float32_, deposit_float32_, moved, run as _run, sums_float32_,
                          sums_float64)


# Terms one element may sum, over every add and every member: each adds less than 2^W to a bin (in magnitude),
# so this many keep |bin| <= 2^63 - 1. A step adds a few per micro-batch; only a huge add_rows could come near.
MAX_TERMS = ((1 << 63) - 1) // _MASK
# Terms whose bins, combined (hi 2^W + lo: each term less than 2^(2W) in magnitude), still fit one int64: up to
# this many over every member, the sum travels as one int64 per element instead of two (``allreduce``).
ONE_INT64_TERMS = ((1 << 63) - 1) // ((1 << (2 * W)) - 1)
# Gradients ``add_later`` copies aside to deposit four at a time: at most this many bytes (three copies), else at once
LATER_BYTES = 256 << 20
PIECE = 1 << 19  # elements per SUM on the one-int64 wire (4 MiB): the next piece is combined while this one travels


def _per_lo_unit(device: Any) -> torch.Tensor:
    """``2^(-(w - 1) W)`` for each window w from MIN_WINDOW to MAX_WINDOW, exactly (float64): a term times it
    counts units of its lo bin."""
    return torch.tensor([2.0 ** (-(w - 1) * W) for w in range(MIN_WINDOW, MAX_WINDOW + 1)],
                        dtype=torch.float64, device=device)


def check_terms(terms: int, world: int = 1) -> None:
    """Refuse a sum of ``terms`` terms per member over ``world`` members that could wrap an int64 bin."""
    if terms * world > MAX_TERMS:
        raise ElasticFlowError(
            f"trainer.reproducible: {terms:,} terms per element x {world} member(s) exceed the {MAX_TERMS:,} "
            "an int64 bin can sum without wrapping",
            "add fewer rows at once (split the sum) or use fewer, larger micro-batches")


class ReproducibleSum:
    """Sums of ``n`` elements whose bits do not depend on the order or grouping of the terms: ``add`` terms in any
    order and grouping, ``allreduce`` across members, ``values`` reads the sums. The same terms give the same bits.

    Example:
        >>> acc = ReproducibleSum(3)
        >>> acc.add(torch.tensor([1e8, 1.0, -2.5])); acc.add(torch.tensor([-1e8, 1e-7, 2.5]))
        >>> acc.values()  # tensor([0.0000e+00, 1.0000e+00, 0.0000e+00], dtype=torch.float64)

    Note: reproducible, not exact: each term's bits below its element's window are dropped (the 1e-7 above keeps
    6 units of 2^-26, 1.0's low bin: the sum is 1 + 8.94e-8). The module docstring states the error bound.
    """

    def __init__(self, n: int, device: Any = "cpu"):
        self.bins = torch.zeros(2, n, dtype=torch.int64, device=device)  # hi, lo: one tensor, one collective
        self.window = torch.full((n,), MIN_WINDOW, dtype=torch.int8, device=device)
        self.terms = 0  # the most terms any element holds (each add and each row counts one): checked, MAX_TERMS
        self._down = _per_lo_unit(device)  # _add_any's scale
        # After an allreduce on the one-int64 wire: each element's sum, hi 2^W + lo, in one int64 (``values`` reads
        # it; an add after that splits it back into the bins first)
        self._combined: Optional[torch.Tensor] = None
        self._wire: Dict[str, torch.Tensor] = {}  # allreduce's buffers, kept from step to step (no page faults)
        self._later: List[torch.Tensor] = []  # add_later's copies, not yet added (at most three) ...
        self._later_at = 0                    # ... and where they go

    @property
    def n(self) -> int:
        return self.window.numel()

    def clear(self) -> None:
        self.bins.zero_()
        self.window.fill_(MIN_WINDOW)
        self.terms = 0
        self._combined = None
        self._later = []

    def _split(self) -> None:
        """The one-int64 sums back into the bins (an add after an allreduce: rare, eager): hi 2^W + lo, lo >= 0."""
        if self._combined is not None:
            v, self._combined = self._combined, None
            self.bins[0] = v >> W
            self.bins[1] = v & _MASK

    def _count(self, terms: int) -> None:
        self._split()
        check_terms(self.terms + terms)
        self.terms += terms

    def add_later(self, terms: torch.Tensor, at: int = 0) -> None:
        """``add`` float32 ``terms`` (a gradient about to be cleared), four at a time: three are copied aside and the
        fourth deposits all four in one pass (``deposit4_float32_``, 2.5x four deposits; the same bits: the sum is
        a function of the set of terms). ``flush`` adds what is left; every read and reduction flushes first.
        Terms of another kind, or more than ``LATER_BYTES`` in three copies, are added at once."""
        t = terms.detach().reshape(-1)
        if t.dtype != torch.float32 or t.device != self.window.device or 3 * 4 * t.numel() > LATER_BYTES:
            self.add(t, at)
            return
        if self._later and (at != self._later_at or t.numel() != self._later[0].numel()):
            self.flush()
        if len(self._later) < 3:
            slot = self._buffer(f"later{len(self._later)}", t.numel(), torch.float32)
            slot.copy_(t)
            self._later.append(slot)
            self._later_at = at
            return
        self._count(4)
        end = at + t.numel()
        _run(deposit4_float32_, (*self._later, t, self.window[at:end], self.bins[0, at:end], self.bins[1, at:end]))
        self._later = []

    def flush(self) -> None:
        """Add the terms ``add_later`` holds back."""
        later, self._later = self._later, []
        for t in later:
            self.add(t, self._later_at)

    def add(self, terms: Any, at: int = 0) -> None:
        """Add ``terms`` (a tensor or array of any float dtype, flattened) to elements ``at .. at + len``."""
        t = torch.as_tensor(terms).detach().reshape(-1)
        self.flush()
        self._count(1)
        if t.dtype == torch.float32 and t.device == self.window.device:
            self._add_float32(t, at)
        else:
            self._add_any(t.to(self.window.device, torch.float64).reshape(1, -1), at)

    def _add_float32(self, t: torch.Tensor, at: int) -> None:
        """``add`` for float32 terms (a gradient): ``deposit_float32``, a compiled loop for a large one."""
        end = at + t.numel()
        _run(deposit_float32_, (t, self.window[at:end], self.bins[0, at:end], self.bins[1, at:end]))

    def add_rows(self, rows: Any, at: int = 0) -> None:
        """Add each row of ``rows`` (an m x k array: m terms for each of elements ``at .. at + k``), as m calls of
        ``add`` would, in one: the same bins (each is the sum of its terms' bits in the final window)."""
        v = torch.as_tensor(rows).detach().to(self.window.device, torch.float64)
        self.flush()
        if v.numel():
            v = v.reshape(v.shape[0], -1)
            self._count(v.shape[0])
            self._add_any(v, at)

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
        units = units.to(torch.int64)  # exact: < 2^(2W)
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
        a MAX of the windows, then an int64 SUM. ``group``: a ``distributed.comm.comm.Group``.

        The wire: the MAX carries each element's window and one more int8, the members' largest ``ceil(log2)`` of
        their term counts, so all of them know a bound on the terms of the whole sum. Where that bound is at most
        ``ONE_INT64_TERMS``, each member sends its bins at the agreed window combined into one int64 (hi 2^W + lo,
        ``combined_at``): 9 bytes per element in all. Otherwise both bins travel: 17. The sums are the same integers
        either way, and ``values`` rounds them the same: the form never changes a bit.

        Note: each member checks its own terms times the world size against ``MAX_TERMS``: enough for the bins
        not to wrap; a member that fails it raises before the MAX."""
        world = getattr(group, "world", 1)
        self.flush()
        check_terms(self.terms, world)
        self._split()
        agreed = self._buffer("agreed", self.n + 1, torch.int8)
        agreed[:-1] = self.window
        agreed[-1] = max(self.terms - 1, 0).bit_length()  # ceil(log2(terms)): terms <= 2^that
        group.allreduce_(agreed, op="max")
        window, bound = agreed[:-1], world << int(agreed[-1])
        if bound <= ONE_INT64_TERMS:
            self._combined = self._sum_combined(group, window)
            self.window.copy_(window)
        else:
            self._move(window, 0, self.n)
            group.allreduce_(self.bins)
        # The sum's terms where the members added alike (a step's sums are cleared before they are used again)
        self.terms *= world

    def _buffer(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._wire.get(name)
        if buf is None:
            buf = self._wire[name] = torch.empty(n, dtype=dtype, device=self.window.device)
        return buf

    def _sum_combined(self, group: Any, window: torch.Tensor) -> torch.Tensor:
        """The members' bins at ``window``, combined (``combined_at_``) and summed: in pieces of ``PIECE``
        elements, each piece's SUM started before the next is combined, so the combining overlaps the wire
        (a group without ``allreduce_start`` sums it whole)."""
        combined = self._buffer("combined", self.n, torch.int64)
        start = getattr(group, "allreduce_start", None)
        step = PIECE if start is not None else self.n
        works = []
        for a in range(0, self.n, step):
            b = min(a + step, self.n)
            _run(combined_at_, (window[a:b], self.window[a:b], self.bins[0, a:b], self.bins[1, a:b], combined[a:b]))
            if start is not None:
                works.append(start(combined[a:b]))
            else:
                group.allreduce_(combined[a:b])
        for work in works:
            group.wait(work)
        return combined

    def values(self, at: int = 0) -> torch.Tensor:
        """The sums of elements ``at ..``, rounded to float64 (a float32 reader rounds again). NaN where a term was
        not finite. Eager: a large float32 reader (a gradient) takes ``values_into``."""
        self.flush()
        if self._combined is not None:
            return combined_float64(self.window[at:], self._combined[at:])
        return sums_float64(self.window[at:], self.bins[0, at:], self.bins[1, at:])

    def values_into(self, out: torch.Tensor, at: int = 0) -> None:
        """Elements ``at .. at + len(out)`` rounded to float64 and then to ``out``'s float32 (the bits of
        ``out.copy_(values())``), written in one pass: a compiled loop for a large one on a CPU."""
        self.flush()
        end = at + out.numel()
        if out.dtype != torch.float32 or out.device != self.window.device or not out.is_contiguous():
            out.copy_(self.values(at)[:out.numel()].reshape(out.shape))
        elif self._combined is not None:
            _run(combined_float32_, (self.window[at:end], self._combined[at:end], out.view(-1)))
        else:
            _run(sums_float32_, (self.window[at:end], self.bins[0, at:end], self.bins[1, at:end], out.view(-1)))


SQUARES_BLOCK = 1 << 20  # elements whose squares go into the sum at a time (~7 int64 temporaries: ~56 MiB)
_SQUARE_SHIFT = 300      # a float32 square is m^2 2^(2E - 300) (m < 2^24, E its biased exponent >= 1): units of 2^-300


class SquaresSum:
    """The sum of the squares of float32 elements, exact, rounded once to float64 at the end: gradient clipping's
    norm under ``trainer.reproducible``, the same bits however the vector is cut among members and at any scale
    (there is no window: a square of a float32 is an integer times 2^-300, and the integers add in Python ints).

    ``add`` a vector's squares, ``allreduce`` adds the members' (an int64 SUM of 31-bit digits), ``values()[0]``
    reads the sum (NaN if an element was not finite). No term limit: each block's histogram is folded into an
    unbounded integer, and W members' normalised digits fit an int64 for W < 2^32.

    Example:
        >>> acc = SquaresSum(); acc.add(torch.tensor([3.0, 4.0])); float(acc.values()[0])
        25.0
    """

    DIGIT = 31   # bits per digit on the wire (its own: not the bins' W): W members' digits fit an int64 for W < 2^32
    DIGITS = 20  # 31-bit digits of the sum on the wire: 2^620 units > any sum of 2^64 float32 squares (< 2^556 units)

    def __init__(self, device: Any = "cpu"):
        self.device = device
        self.total = 0          # the exact sum, in units of 2^-300
        self.nonfinite = 0      # elements that were NaN or infinite

    def add(self, t: torch.Tensor) -> None:
        """Add the squares of ``t``'s elements (float32, or narrower floats, converted exactly; float64 is rounded
        to float32 first)."""
        flat = t.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        for lo in range(0, flat.numel(), SQUARES_BLOCK):
            self._add_block(flat[lo:lo + SQUARES_BLOCK])

    def _add_block(self, x: torch.Tensor) -> None:
        """One block: a histogram of the squares' integer parts by exponent (two halves of 24 bits each, so a
        bin sums < 2^39 terms without wrapping), folded into ``total``. Deterministic on a GPU too (index_add_)."""
        bits = x.view(torch.int32)
        biased = ((bits >> 23) & 0xFF).long()
        mantissa = ((bits & 0x7FFFFF) | ((biased != 0).to(torch.int32) << 23)).to(torch.int64)
        square = mantissa * mantissa  # < 2^48, exact
        hist = torch.zeros(2, 256, dtype=torch.int64, device=x.device)
        hist[0].index_add_(0, biased, square >> 24)
        hist[1].index_add_(0, biased, square & ((1 << 24) - 1))
        high, low = hist.tolist()  # a sync point on a GPU
        self.nonfinite += (high[255] + low[255]) > 0  # inf or NaN (a nonzero mantissa with the implicit bit)
        for e in range(255):
            if high[e] or low[e]:
                self.total += ((high[e] << 24) + low[e]) << (2 * max(e, 1))

    def _digits(self) -> torch.Tensor:
        if self.total >> (self.DIGIT * self.DIGITS):
            raise ElasticFlowError("trainer.reproducible: a sum of squares of 2^320 or more does not fit the 20 "
                                   "digits it travels in (it takes more than 2^64 float32 elements)",
                                   "clip a gradient of fewer elements, or clip per parameter group")
        mask = (1 << self.DIGIT) - 1
        return torch.tensor([(self.total >> (self.DIGIT * i)) & mask for i in range(self.DIGITS)] + [self.nonfinite],
                            dtype=torch.int64, device=self.device)

    def allreduce(self, group: Any) -> None:
        """Add the members' sums (every member calls it, in the same order as its other collectives)."""
        digits = self._digits()
        group.allreduce_(digits)
        got = digits.tolist()
        self.total = sum(d << (self.DIGIT * i) for i, d in enumerate(got[:-1]))
        self.nonfinite = got[-1]

    def values(self) -> torch.Tensor:
        """The sum, correctly rounded to float64 (one element); NaN if an element was NaN or infinite."""
        if self.nonfinite:
            value = float("nan")
        else:
            try:
                value = self.total / (1 << _SQUARE_SHIFT)  # Python's int division: correctly rounded
            except OverflowError:
                value = float("inf")
        return torch.tensor([value], dtype=torch.float64)


def sum_squares_reproducibly(t: torch.Tensor) -> SquaresSum:
    """The sum of the squares of ``t``'s elements, in a ``SquaresSum`` (``values()[0]``; its ``allreduce`` adds
    the members'): gradient clipping's norm under ``trainer.reproducible``, the same bits however the vector is
    cut among members, exact until its one rounding to float64."""
    acc = SquaresSum(t.device)
    acc.add(t)
    return acc
