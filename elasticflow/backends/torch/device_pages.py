"""A GPU's flat vector whose memory can be given back piece by piece while the tensor over it stays valid:
``trainer.shard=parameters`` on a GPU (``_util/pages.py`` is the host's, with the same methods).

A GPU allocation cannot give back part of itself, so the vector is made with CUDA's virtual memory management
(the driver's ``cuMemAddressReserve``/``cuMemCreate``/``cuMemMap``, through ctypes: the driver library is on
every machine with a GPU, and no package is needed). The whole vector's address range is reserved once and
the tensor spans it; physical memory is mapped per granule (2 MiB on current GPUs) and unmapped where given
back, so the address space stays reserved and only the mapped granules take device memory. This is what
FSDP2 gets by resizing each unit's storage to 0, with one flat vector kept (the optimizer's formulas,
the checkpoints and the ranges see one tensor, as on the host).

Unlike a host page, an unmapped granule is not zeros: a kernel touching it is a fault that ends the process's
CUDA context. So the callers keep one protocol, which the CPU suite checks with ``ELASTICFLOW_STRICT_PAGES=1``
(``tests/test_shard_params.py``, ``tests/test_shard_frozen.py``): memory that may have been given back is
``ensure``d (mapped, zeroed) before it is written or read. ``drop`` first waits for the device's work (a sync point per unit given back): a kernel
still reading the granule would fault. ``cuMemCreate`` draws from the driver, not from torch's caching allocator:
where it runs out, the allocator's cached blocks are given back and it tries once more.

The driver's calls act on the calling thread's current context, which nothing guarantees (a thread that has not
touched the GPU has none): each call is made with the device's primary context (the one torch's runtime uses)
pushed, retained from the reservation's start to its release. A granule whose map fails after ``cuMemCreate``
gives its physical memory back before the error is raised, and a vector whose build fails gives back what it
had mapped and its address range.

Note: written without a GPU to run on (none was lent while it was built); ``scripts/ops/gpu_check.sh`` runs it.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator, List, Optional, Tuple

import torch

from ...errors import ElasticFlowError

FLOAT = 4
# The driver API's constants (cuda.h)
_PINNED, _ON_DEVICE, _READ_WRITE, _GRANULARITY_MINIMUM = 1, 1, 3, 0
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: Optional[ctypes.CDLL] = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise ElasticFlowError(f"trainer.shard=parameters on a GPU needs the CUDA driver library ({exc})",
                                   "run on a machine with NVIDIA's driver, or pass trainer.shard=gradients") from exc
        for name in ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                     "cuMemRelease", "cuMemAddressFree", "cuMemGetAllocationGranularity", "cuDeviceGet",
                     "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxPushCurrent_v2",
                     "cuCtxPopCurrent_v2"):
            getattr(_driver, name).restype = ctypes.c_int
    return _driver


_MEMORY_HINT = ("the GPU is out of memory, or its driver has no virtual memory management (CUDA 10.2 or later); "
                "pass trainer.shard=gradients")
_CONTEXT_HINT = ("no CUDA context could be made current on this GPU (is it in exclusive-process mode and held by "
                 "another process? see nvidia-smi -q -d COMPUTE); or pass trainer.shard=gradients")


def _check(result: int, what: str, hint: str = _MEMORY_HINT) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        reason = text.value.decode() if text.value else f"CUresult {result}"
        raise ElasticFlowError(f"trainer.shard=parameters: the CUDA driver's {what} failed: {reason}", hint)


class _Reservation:
    """The vector's address range and the physical granules mapped into it. Held by the tensors over it (through
    ``_Array``), never by the vector: the tensors' memory goes when the last of them does, and no reference
    cycle runs through the C++ deleter that keeps it (the collector could not see such a cycle)."""

    def __init__(self, n: int, device: torch.device):
        self.device = device
        self.handles: List[int] = []  # per granule: its physical memory's handle, 0 where unmapped
        self.base = self.size = 0
        self.context: Optional[int] = None
        cu = _cuda()
        index = device.index if device.index is not None else torch.cuda.current_device()
        # The driver's calls act on the calling thread's current context, and a thread may have none (one that
        # never touched the GPU) or another device's: the device's primary context (torch's runtime's), held
        # until release() and pushed around each call. Retaining it makes it where nothing has yet.
        ordinal, context = ctypes.c_int(), ctypes.c_void_p()
        _check(cu.cuDeviceGet(ctypes.byref(ordinal), ctypes.c_int(index)), "cuDeviceGet", _CONTEXT_HINT)
        _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(context), ordinal), f"cuDevicePrimaryCtxRetain (cuda:{index})",
               _CONTEXT_HINT)
        self.ordinal, self.context = ordinal, context.value
        self.prop = _AllocationProp(type=_PINNED, location=_Location(type=_ON_DEVICE, id=index))
        self.access = _AccessDesc(location=_Location(type=_ON_DEVICE, id=index), flags=_READ_WRITE)
        granule, base = ctypes.c_size_t(), ctypes.c_uint64()
        try:
            with self.current():
                _check(cu.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(self.prop),
                                                        _GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
                self.granule = int(granule.value)
                size = -(-max(1, n * FLOAT) // self.granule) * self.granule
                _check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(size),
                                              ctypes.c_size_t(self.granule), ctypes.c_uint64(0), ctypes.c_uint64(0)),
                       "cuMemAddressReserve")
        except BaseException:
            self.release()
            raise
        self.base, self.size = int(base.value), size
        self.handles = [0] * (self.size // self.granule)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The driver's calls inside act on this device's primary context (pushed on this thread, popped after)."""
        cu = _cuda()
        _check(cu.cuCtxPushCurrent_v2(ctypes.c_void_p(self.context)), "cuCtxPushCurrent", _CONTEXT_HINT)
        try:
            yield
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def map(self, g: int) -> None:
        """Granule ``g`` backed by fresh physical memory (its contents: whatever that memory held). On a failure
        nothing stays held: the memory created is released (and unmapped where it was mapped)."""
        cu, handle = _cuda(), ctypes.c_uint64()
        with self.current():
            result = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.granule), ctypes.byref(self.prop),
                                    ctypes.c_uint64(0))
            if result == _OUT_OF_MEMORY:  # torch's caching allocator may hold free blocks: given back, then again
                torch.cuda.empty_cache()
                result = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.granule),
                                        ctypes.byref(self.prop), ctypes.c_uint64(0))
            _check(result, "cuMemCreate")
            address, mapped = ctypes.c_uint64(self.base + g * self.granule), False
            try:
                _check(cu.cuMemMap(address, ctypes.c_size_t(self.granule), ctypes.c_size_t(0), handle,
                                   ctypes.c_uint64(0)), "cuMemMap")
                mapped = True
                _check(cu.cuMemSetAccess(address, ctypes.c_size_t(self.granule), ctypes.byref(self.access),
                                         ctypes.c_size_t(1)), "cuMemSetAccess")
            except BaseException:
                # Best effort, the error above is the one to report: a mapping holds its memory, so unmap first.
                if mapped:
                    cu.cuMemUnmap(address, ctypes.c_size_t(self.granule))
                cu.cuMemRelease(handle)
                raise
        self.handles[g] = int(handle.value)

    def unmap(self, g: int) -> None:
        cu = _cuda()
        with self.current():
            _check(cu.cuMemUnmap(ctypes.c_uint64(self.base + g * self.granule), ctypes.c_size_t(self.granule)),
                   "cuMemUnmap")
            handle, self.handles[g] = self.handles[g], 0  # unmapped: never unmapped again, even if release fails
            _check(cu.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")

    def release(self) -> None:
        """Every granule unmapped and released, the address range freed, the context let go; each step tried even
        where one before it failed (at interpreter exit the driver may be gone already). Idempotent."""
        if self.context is None:
            return
        cu = _cuda()
        if any(self.handles):
            try:
                torch.cuda.synchronize(self.device)  # a kernel still reading a granule would fault
            except Exception:  # noqa: BLE001
                pass
        for g, handle in enumerate(self.handles):
            if handle:
                try:
                    self.unmap(g)
                except Exception:  # noqa: BLE001
                    pass
        try:
            if self.base:
                with self.current():
                    cu.cuMemAddressFree(ctypes.c_uint64(self.base), ctypes.c_size_t(self.size))
        except Exception:  # noqa: BLE001
            pass
        self.base, self.handles = 0, []
        try:
            cu.cuDevicePrimaryCtxRelease_v2(self.ordinal)
        except Exception:  # noqa: BLE001
            pass
        self.context = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
            pass


class _Array:
    """What ``torch.as_tensor`` takes to view device memory it does not own (``__cuda_array_interface__``)."""

    def __init__(self, reservation: _Reservation, n: int):
        self.reservation = reservation  # kept by the tensor's deleter: the memory outlives every view
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (reservation.base, False),
                                         "version": 3, "strides": None}


class DeviceVector:
    """A 1-D float32 tensor of ``n`` elements on ``device`` (a GPU) over reserved address space, every granule
    mapped at first (the engine writes the whole model into it); ``drop`` unmaps, ``ensure`` maps again.

    ``tensor`` and ``alias`` are two tensors over the same memory with their own version counters (as the
    host's ``PagedVector``: a unit arriving through ``alias`` is not an in-place change autograd would see).
    """

    def __init__(self, n: int, device: torch.device):
        self.n, self.device = int(n), torch.device(device)
        torch.cuda.init()
        with torch.cuda.device(self.device):
            self._res = _Reservation(self.n, self.device)
            try:
                for g in range(len(self._res.handles)):
                    self._res.map(g)
            except BaseException:  # what was mapped goes back now, not when the collector gets to it
                self._res.release()
                raise
        self.granule, self.size = self._res.granule, self._res.size
        self.tensor = torch.as_tensor(_Array(self._res, self.n), device=self.device)
        self.alias = torch.as_tensor(_Array(self._res, self.n), device=self.device)

    def granules(self, lo: int, hi: int) -> Tuple[int, int]:
        """The granules wholly inside elements [lo, hi) (``drop`` gives them back)."""
        return -(-lo * FLOAT // self.granule), hi * FLOAT // self.granule

    def drop(self, lo: int, hi: int) -> int:
        """Give back the whole granules inside elements [lo, hi); returns the bytes given back. Waits for all
        the device's queued work first (a sync point; a kernel on any stream still reading them would fault)."""
        first, last = self.granules(lo, hi)
        mapped = [g for g in range(first, last) if self._res.handles[g]]
        if not mapped:
            return 0
        torch.cuda.synchronize(self.device)
        for g in mapped:
            self._res.unmap(g)
        return len(mapped) * self.granule

    def ensure(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) mapped: the granules given back among them mapped again and zeroed."""
        if hi <= lo:
            return
        first, last = lo * FLOAT // self.granule, -(-hi * FLOAT // self.granule)
        missing = [g for g in range(first, last) if not self._res.handles[g]]
        if not missing:
            return
        per = self.granule // FLOAT
        with torch.cuda.device(self.device):
            for g in missing:
                self._res.map(g)
                # Fresh physical memory holds whatever it held: zeros, as a host page given back reads
                self.alias[g * per:min(self.n, (g + 1) * per)].zero_()

    def zero(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) set to 0: their whole granules given back, the rest written where mapped (a granule
        given back reads as zeros once ensured)."""
        first, last = self.granules(lo, hi)
        per = self.granule // FLOAT
        for g in range(lo // per, -(-hi // per)):
            if (g < first or g >= last) and self._res.handles[g]:
                self.alias[max(lo, g * per):min(hi, (g + 1) * per)].zero_()
        if last > first:
            self.drop(lo, hi)

    def resident_bytes(self) -> int:
        """Device bytes mapped now, for tests and benchmarks."""
        return sum(1 for h in self._res.handles if h) * self.granule
