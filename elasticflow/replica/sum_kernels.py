"""The reproducible sums' elementwise arithmetic (``exact_sum.py`` holds the sums and says why), and its loops
compiled ahead of time.

Every function here is integer and power-of-two arithmetic without a branch, so eager torch and one compiled
loop (AOTInductor) give the same bits. On a CPU, from ``COMPILE_FROM`` elements, each runs as a loop compiled
ahead of time (~20x eager), built once per machine in a background process at low priority while the first steps
run eager, and loaded by every process from a cache the machine's processes share (``_Kernels``).
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

log = logging.getLogger("elasticflow")


W = 26                 # bits per bin: a term's two bins hold < 2^52, so 2^11 terms' bins fit one int64 on the wire
MIN_WINDOW = -36       # below 2^-936 terms lose their bits (float32's smallest is 2^-149)
MAX_WINDOW = 40        # float64's largest finite values
NONFINITE = 100        # the window of an element some term of which was NaN or infinite (above any real one)
_MASK = (1 << W) - 1
OWN_WINDOW_MULTIPLIER = 2521  # floor(x / 26) == (x * 2521) >> 16 for 0 <= x < 442 (deposit_float32)


def moved(window: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor):
    """Bins ``hi``, ``lo`` at windows ``held`` raised to ``window`` (>= held): up one window, hi becomes lo and the
    old lo goes; up two or more, both go. Returns (window as int8, hi, lo). In multiplications by 0 or 1, not
    ``torch.where``: a where on a random mask costs as much as ten of them (mispredicted branches)."""
    raised = window.to(torch.int64) - held.to(torch.int64)
    same, up_one = (raised == 0).to(torch.int64), (raised == 1).to(torch.int64)
    return window.to(torch.int8), hi * same, lo * same + hi * up_one


def own_window(t: torch.Tensor) -> torch.Tensor:
    """The window of each float32 term of ``t`` (int32): the bin of its leading bit, NONFINITE for NaN or inf."""
    biased = (t.view(torch.int32) >> 23) & 0xFF
    # The leading bit's position is biased - 127 (subnormals too: all in bin -5); floor((biased - 127) / 26) =
    # floor((biased + 3) / 26) - 5 by a multiply and a shift (OWN_WINDOW_MULTIPLIER: exact for 0 <= biased + 3 < 442,
    # tests/test_exact.py checks all 256). A NaN or infinity (biased 255, bin 4) lands at NONFINITE.
    return (((biased + (5 * W - 127)) * OWN_WINDOW_MULTIPLIER) >> 16) - 5 + \
        (biased == 0xFF).to(torch.int32) * (NONFINITE - 4)


def units_at(t: torch.Tensor, window: torch.Tensor):
    """Float32 terms ``t`` in units of the lo bin at ``window`` (>= their own), truncated toward zero, split into
    the (hi, lo) they add to the bins, signed."""
    bits = t.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    normal = (biased != 0).to(torch.int32)
    mantissa = ((bits & 0x7FFFFF) | (normal << 23)).to(torch.int64)
    # Units of the lo bin, 2^(W (window - 1)): mantissa * 2^(biased - 149 - normal - W (window - 1)), truncated: a
    # left shift by 39 (mantissa < 2^24: below 2^63) and a right shift by the rest (from 11: units < 2^(2W); 63 at
    # most: C's >> is undefined from 64 on, and a compiled loop is C)
    shift = (39 + 149 - W + normal - biased + W * window).clamp(max=63)
    units = (mantissa << 39) >> shift.to(torch.int64)
    sign = (bits >> 31).to(torch.int64)  # 0 or -1: x ^ sign - sign is x or -x
    return ((units >> W) ^ sign) - sign, ((units & _MASK) ^ sign) - sign


def deposit_float32(t: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor):
    """Float32 terms ``t`` added to bins ``hi``, ``lo`` at windows ``held``: returns the new (window, hi, lo).

    From the terms' bits, in integer operations without a branch, so that eager torch and one compiled loop
    (``_Kernels``) give the same bits. The same sums as ``ReproducibleSum._add_any``: a float32 zero's window is
    float32's lowest, -5, where ``_add_any`` gives MIN_WINDOW (no float32 term has bits below either)."""
    window = torch.maximum(own_window(t), held.to(torch.int32))
    window8, hi, lo = moved(window, held, hi, lo)
    add_hi, add_lo = units_at(t, window)
    return window8, hi + add_hi, lo + add_lo


def deposit_float32_(t: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``deposit_float32`` written back into ``held``, ``hi``, ``lo``: compiled, one loop that reads and writes
    each element's 17 bytes once (returned and then copied, 3x the time on 2.2M elements)."""
    window, new_hi, new_lo = deposit_float32(t, held, hi, lo)
    held.copy_(window)
    hi.copy_(new_hi)
    lo.copy_(new_lo)


def deposit4_float32_(t0: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, t3: torch.Tensor, held: torch.Tensor,
                      hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Four float32 term vectors deposited at once: the window raised once, to the largest of the four, and their
    units added there; the bins read and written once for four terms (2.5x four ``deposit_float32_`` on a CPU).
    The same bits as four deposits in any order: the sum is a function of the set of terms."""
    window = torch.maximum(torch.maximum(torch.maximum(own_window(t0), own_window(t1)),
                                         torch.maximum(own_window(t2), own_window(t3))), held.to(torch.int32))
    window8, hi_sum, lo_sum = moved(window, held, hi, lo)
    for t in (t0, t1, t2, t3):
        add_hi, add_lo = units_at(t, window)
        hi_sum, lo_sum = hi_sum + add_hi, lo_sum + add_lo
    held.copy_(window8)
    hi.copy_(hi_sum)
    lo.copy_(lo_sum)


def combined_at_(window: torch.Tensor, held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Bins ``hi``, ``lo`` at windows ``held`` raised to ``window`` (``moved``) and combined into one int64 each,
    written to ``out``: hi 2^W + lo (the one-int64 wire: fits while the whole sum has at most ``ONE_INT64_TERMS``
    terms)."""
    _, hi, lo = moved(window, held, hi, lo)
    out.copy_((hi << W) + lo)


def combined_float64(window: torch.Tensor, combined: torch.Tensor) -> torch.Tensor:
    """``sums_float64`` of sums held combined (``combined_at``): the same integer, rounded once, the same bits."""
    unit = ((W * (window.to(torch.int64).clamp(MIN_WINDOW, MAX_WINDOW) - 1) + 1023) << 52).view(torch.float64)
    return torch.where(window >= NONFINITE, float("nan"), combined.to(torch.float64) * unit)


def sums_float32_(window: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> None:
    """``sums_float64`` rounded again to float32, written to ``out`` (a gradient): one pass, no float64 vector."""
    out.copy_(sums_float64(window, hi, lo))


def combined_float32_(window: torch.Tensor, combined: torch.Tensor, out: torch.Tensor) -> None:
    """``combined_float64`` rounded again to float32, written to ``out``."""
    out.copy_(combined_float64(window, combined))


def sums_float64(window: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The value of bins ``hi``, ``lo`` at ``window``: (hi 2^W + lo), rounded to float64, times the lo bin's
    unit 2^(W (window - 1)), made from its exponent bits (exact: a power of two). NaN where not finite."""
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

    names = ("deposit_float32_", "deposit4_float32_", "combined_at_", "sums_float32_", "combined_float32_")

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
        source = "".join(inspect.getsource(f) for f in (moved, own_window, units_at, deposit_float32, deposit_float32_,
                                                         deposit4_float32_, sums_float64,
                                                         sums_float32_, combined_float32_,
                                                         combined_at_, combined_float64))
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
    code = f"from elasticflow.replica.sum_kernels import build_main; build_main({str(folder)!r}, {key!r}, {str(lock)!r})"
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


class _Deposit4(torch.nn.Module):
    def forward(self, t0, t1, t2, t3, held, hi, lo):
        return deposit4_float32_(t0, t1, t2, t3, held, hi, lo)


class _Sums(torch.nn.Module):
    def forward(self, window, hi, lo, out):
        return sums_float32_(window, hi, lo, out)


class _Combined(torch.nn.Module):
    def forward(self, window, held, hi, lo, out):
        return combined_at_(window, held, hi, lo, out)


class _CombinedSums(torch.nn.Module):
    def forward(self, window, combined, out):
        return combined_float32_(window, combined, out)


_MODULES = {"deposit_float32_": _Deposit, "deposit4_float32_": _Deposit4, "sums_float32_": _Sums, "combined_at_": _Combined,
            "combined_float32_": _CombinedSums}


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
    def window() -> torch.Tensor:
        return torch.full((n,), MIN_WINDOW, dtype=torch.int8)

    def ints() -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64)

    examples = {"deposit_float32_": (torch.randn(n), window(), ints(), ints()),
                "deposit4_float32_": (*(torch.randn(n) for _ in range(4)), window(), ints(), ints()),
                "sums_float32_": (window(), ints(), ints(), torch.zeros(n)),
                "combined_at_": (window(), window(), ints(), ints(), ints()),
                "combined_float32_": (window(), ints(), torch.zeros(n))}
    length = torch.export.Dim("n", min=2)
    for name in _Kernels.names:
        final = folder / f"{name}-{key}.pt2"
        if final.exists():
            continue
        args = examples[name]
        program = torch.export.export(_MODULES[name](), args,
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


def run(fn: Any, args: tuple) -> Any:
    """``fn(*args)``: its compiled kernel where the sums are large, on a CPU, and the kernel is built."""
    t = args[0]
    if t.numel() >= COMPILE_FROM and t.device.type == "cpu" and all(a.is_contiguous() for a in args):
        kernel = _kernels.get(fn.__name__)
        if kernel is not None:
            out = kernel.run(list(args))
            return out[0] if out else None
    return fn(*args)
