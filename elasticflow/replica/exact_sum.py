"""Sums whose bits depend on neither the order nor the grouping of their terms (``trainer.reproducible``).

A float32 sum rounds after every addition, so ``(g0 + g1) + (g2 + g3)`` (two workers) and
``((g0 + g1) + g2) + g3`` (one) differ in the last bits, and a long run amplifies them. Here each element's
sum is a fixed-point number held in two int64 *bins*, which add exactly in any order: an indexed sum in the
manner of Demmel and Nguyen's reproducible summation (ReproBLAS), with two bins and integers for carries.
It is reproducible, not exact: each term is truncated to the element's window first (``docs/exactness.md``).

- Exponents are cut into absolute bins of ``W`` = 31 bits; an element's *window* is the bin of the leading
  bit of the largest term it has seen. Its ``hi`` bin counts units of ``2^(window W)``, its ``lo`` bin units
  of ``2^((window - 1) W)``; a term's bits below ``lo`` are dropped (truncated), the same bits whoever adds it.
- A larger term raises the window: ``hi`` becomes ``lo`` and the old ``lo`` is dropped (all of it: its bits
  lie below the new window for every term). So the final value is a function of the set of terms alone:
  the sum, over the terms, of their bits in the window of the largest one.
- Members agree on the window first (a MAX of one int8 per element), move their bins to it, then sum the
  bins (int64 SUM: each term adds less than ``2^31`` to a bin, so ``MAX_TERMS`` terms in all, over every
  member, fit; more are refused before a bin can wrap).
- The value is ``hi 2^31 + lo`` in float64 arithmetic (one rounding while ``|hi| < 2^53``), then (by the
  caller) rounded to float32: twice, not once.
- Error: a term loses less than one unit of ``lo``, which is at most ``2^-31`` of the largest term, so T terms
  are off by less than ``T 2^-31 max|term|`` before the final rounding. That bound is below float32
  accumulation's worst case (``(T - 1) 2^-24 sum|term|``), but it is a bound, not a promise per case:
  ``[1, -1, 2^-32]`` sums to 0.0 here and to ``2^-32`` in float32.
- A NaN or infinite term marks the element non-finite (window ``NONFINITE``, which the MAX spreads); its
  sum is NaN, so the non-finite check of the step still sees it.

The squared norm (gradient clipping's) has its own accumulator, ``SquaresSum``: exact, rounded once.

Costs: 17 bytes per element (two int64 bins, the int8 window) where a float32 sum has 4, and a pass over them
per term vector: on a CPU, one loop compiled ahead of time for a large gradient, built once per machine in a
background process while the first steps run eager (``_Kernels``); ``scripts/bench/bench_exact.py``.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..errors import ElasticFlowError

log = logging.getLogger("elasticflow")

W = 31                 # bits per bin: a term's two bins hold < 2^62
MIN_WINDOW = -30       # below 2^-930 terms lose their bits (float32's smallest is 2^-149)
MAX_WINDOW = 33        # float64's largest finite values
NONFINITE = 100        # the window of an element some term of which was NaN or infinite (above any real one)
_MASK = (1 << W) - 1
# Terms one element may sum, over every add and every member: each adds less than 2^31 to a bin (in magnitude),
# so this many keep |bin| <= 2^63 - 1. A step adds a few per micro-batch; only a huge add_rows could come near.
MAX_TERMS = ((1 << 63) - 1) // _MASK


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
        >>> acc.add(torch.tensor([1e8, 1.0, -2.5])); acc.add(torch.tensor([-1e8, 1e-8, 2.5]))
        >>> acc.values()  # tensor([0.0000e+00, 1.0000e+00, 0.0000e+00], dtype=torch.float64)

    Note: reproducible, not exact: each term's bits below its element's window are dropped (the 1e-8 above keeps
    21 units of 2^-31, 1.0's low bin: the sum is 1 + 9.78e-9). The module docstring states the error bound.
    """

    def __init__(self, n: int, device: Any = "cpu"):
        self.bins = torch.zeros(2, n, dtype=torch.int64, device=device)  # hi, lo: one tensor, one collective
        self.window = torch.full((n,), MIN_WINDOW, dtype=torch.int8, device=device)
        self.terms = 0  # the most terms any element holds (each add and each row counts one): checked, MAX_TERMS
        self._down = _per_lo_unit(device)  # _add_any's scale

    @property
    def n(self) -> int:
        return self.window.numel()

    def clear(self) -> None:
        self.bins.zero_()
        self.window.fill_(MIN_WINDOW)
        self.terms = 0

    def _count(self, terms: int) -> None:
        check_terms(self.terms + terms)
        self.terms += terms

    def add(self, terms: Any, at: int = 0) -> None:
        """Add ``terms`` (a tensor or array of any float dtype, flattened) to elements ``at .. at + len``."""
        t = torch.as_tensor(terms).detach().reshape(-1)
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
        a MAX of the windows, then an int64 SUM of the bins. ``group``: a ``distributed.comm.comm.Group``.

        Note: each member checks its own terms times the world size against ``MAX_TERMS`` (the others' counts
        are not on the wire): enough for the sum not to wrap; a member that fails it raises before the MAX."""
        world = getattr(group, "world", 1)
        check_terms(self.terms, world)
        window = self.window.clone()
        group.allreduce_(window, op="max")
        self._move(window, 0, self.n)
        group.allreduce_(self.bins)
        # The sum's terms where the members added alike (a step's sums are cleared before they are used again)
        self.terms *= world

    def values(self) -> torch.Tensor:
        """The sums, rounded to float64 (a float32 reader rounds again). NaN where a term was not finite."""
        return _run(sums_float64, (self.window, self.bins[0], self.bins[1]))


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
        if self.total >> (W * self.DIGITS):
            raise ElasticFlowError("trainer.reproducible: a sum of squares of 2^320 or more does not fit the 20 "
                                   "digits it travels in (it takes more than 2^64 float32 elements)",
                                   "clip a gradient of fewer elements, or clip per parameter group")
        return torch.tensor([(self.total >> (W * i)) & _MASK for i in range(self.DIGITS)] + [self.nonfinite],
                            dtype=torch.int64, device=self.device)

    def allreduce(self, group: Any) -> None:
        """Add the members' sums (every member calls it, in the same order as its other collectives)."""
        digits = self._digits()
        group.allreduce_(digits)
        got = digits.tolist()
        self.total = sum(d << (W * i) for i, d in enumerate(got[:-1]))
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
    (``_Kernels``) give the same bits. The same sums as ``ReproducibleSum._add_any``: a float32 zero's window is
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
    """The value of bins ``hi``, ``lo`` at ``window``: (hi 2^31 + lo), rounded to float64, times the lo bin's
    unit 2^(31 (window - 1)), made from its exponent bits (exact: a power of two). NaN where not finite."""
    unit = ((W * (window.to(torch.int64).clamp(MIN_WINDOW, MAX_WINDOW) - 1) + 1023) << 52).view(torch.float64)
    value = (hi.to(torch.float64) * float(1 << W) + lo.to(torch.float64)) * unit
    return torch.where(window >= NONFINITE, float("nan"), value)  # a mask seldom true: no mispredictions


# On a CPU, from COMPILE_FROM elements, deposit_float32_ and sums_float64 run as loops compiled ahead of time
# (AOTInductor, any size: one build for all), ~20x faster than eager. The build (~20-40 s of a core) never runs
# on the step path: the first process that needs the kernels starts it in a background process at low priority
# and sums eager meanwhile (the same integer and power-of-two arithmetic, the same bits); every process then
# loads the built packages (~10 ms) from a cache shared by the machine's processes. A GPU sums eager: its
# elementwise passes are cheap there, and compiling per process is what stalled joins (docs/benchmarks.md).
COMPILE_FROM = 1 << 18
BUILD_STALE_S = 900  # a build lock older than this (or whose builder is gone), or a failed build's note, is retried


class _Kernels:
    """The compiled kernels of this process: loaded once their package is on disk, None until then."""

    names = ("deposit_float32_", "sums_float64")

    def __init__(self):
        self.loaded: Dict[str, Any] = {}
        self.off = False  # True once a build failed or a package would not load: eager for good (the same bits)
        self.builder: Optional[subprocess.Popen] = None
        self.started = False

    @staticmethod
    def folder() -> Path:
        root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                         f"torchinductor_uid{os.getuid()}")
        return Path(root) / "elasticflow_sums"

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def key() -> str:
        """Which build fits this process: torch's version, the machine, and the source of the compiled code."""
        source = "".join(inspect.getsource(f) for f in (moved, deposit_float32, deposit_float32_, sums_float64))
        text = f"{torch.__version__} {platform.machine()} {sys.version_info[:2]} {W} {NONFINITE} {source}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def path(self, name: str) -> Path:
        return self.folder() / f"{name}-{self.key()}.pt2"

    def get(self, name: str) -> Any:
        """The loaded kernel, or None (eager): starts the build the first time none is on disk."""
        kernel = self.loaded.get(name)
        if kernel is not None or self.off:
            return kernel
        if self.builder is not None and self.builder.poll() is not None:
            self.builder = None  # reaped
        path = self.path(name)
        if path.exists():
            try:
                kernel = self.loaded[name] = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
            except Exception as exc:  # noqa: BLE001 - a package this torch cannot load: eager, the same bits
                self._give_up(f"loading {path} failed: {str(exc).splitlines()[0][:200]}")
            return kernel
        failed = path.with_suffix(".failed")
        if failed.exists() and time.time() - failed.stat().st_mtime < BUILD_STALE_S:
            self._give_up(failed.read_text()[:300])
        elif not self.started:  # an older failure is tried again (a build killed for memory, say)
            failed.unlink(missing_ok=True)
            self.started = True
            self.builder = start_build(self.folder(), self.key())
        return None

    def _give_up(self, why: str) -> None:
        log.warning("reproducible sums run eager, slower (%s)", why)
        self.off = True


_kernels = _Kernels()


def start_build(folder: Path, key: str) -> Optional[subprocess.Popen]:
    """Start building the kernels in a background process unless one is at it (a lock file); the builder
    writes each package under a temporary name and renames it, so a reader sees a whole one or none."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / f"build-{key}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            if not _stale(lock):
                return None  # another process builds: this one loads the packages when they appear
            lock.unlink(missing_ok=True)
    else:
        return None
    code = f"from elasticflow.replica.exact_sum import build_main; build_main({str(folder)!r}, {key!r}, {str(lock)!r})"
    # Its own session and no inherited pipes: a launcher that reads the worker's output to its end, or kills its
    # process group, does not wait for (or cut short) a build that serves the machine's later processes too.
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    os.write(fd, str(proc.pid).encode())
    os.close(fd)
    log.info("building the reproducible sums' compiled kernels in the background (pid %d); eager until then",
             proc.pid)
    return proc


def _stale(lock: Path) -> bool:
    try:
        pid = int(lock.read_text() or 0)
        age = time.time() - lock.stat().st_mtime
    except (OSError, ValueError):
        return False  # being written, or just removed: not ours to take
    if age > BUILD_STALE_S:
        return True
    if pid:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


class _Deposit(torch.nn.Module):
    def forward(self, t, held, hi, lo):
        return deposit_float32_(t, held, hi, lo)


class _Sums(torch.nn.Module):
    def forward(self, window, hi, lo):
        return sums_float64(window, hi, lo)


def build(folder: Path, key: str) -> None:
    """Build both kernels' packages into ``folder`` (the background builder's work; tests and benchmarks call it
    to wait for them): one export with a dynamic length each, so every size runs the same package."""
    import torch._inductor  # noqa: F401 - heavy: only the builder imports it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a kernel without an OpenMP region: one thread in every worker, as the mode runs
    try:
        _build(folder, key)
    finally:
        torch.set_num_threads(threads)


def _build(folder: Path, key: str) -> None:
    n = 4096  # an example length; the export keeps it dynamic (from 2 up)
    examples = {"deposit_float32_": (torch.randn(n), torch.full((n,), MIN_WINDOW, dtype=torch.int8),
                                     torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)),
                "sums_float64": (torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.int64),
                                 torch.zeros(n, dtype=torch.int64))}
    length = torch.export.Dim("n", min=2)
    for name in _Kernels.names:
        final = folder / f"{name}-{key}.pt2"
        if final.exists():
            continue
        args = examples[name]
        program = torch.export.export(_Deposit() if name == "deposit_float32_" else _Sums(), args,
                                      dynamic_shapes=tuple({0: length} for _ in args))
        partial = folder / f".{name}-{key}-{os.getpid()}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
        os.replace(partial, final)


def build_main(folder: str, key: str, lock: str) -> None:
    """The background builder's entry point: low priority, a ``.failed`` note where the build fails (the workers
    then stay eager and say why once), the lock removed at the end."""
    os.nice(10)
    try:
        build(Path(folder), key)
    except Exception as exc:  # noqa: BLE001 - no C++ compiler, say: noted for the workers
        for name in _Kernels.names:
            Path(folder, f"{name}-{key}.failed").write_text(f"the kernels' build failed: {exc!r}"[:2000])
    finally:
        Path(lock).unlink(missing_ok=True)


def _run(fn: Any, args: tuple) -> Any:
    """``fn(*args)``: its compiled kernel where the sums are large, on a CPU, and the kernel is built."""
    t = args[0]
    if t.numel() >= COMPILE_FROM and t.device.type == "cpu" and all(a.is_contiguous() for a in args):
        kernel = _kernels.get(fn.__name__)
        if kernel is not None:
            out = kernel.run(list(args))
            return out[0] if out else None
    return fn(*args)
