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

Note: written without a GPU to run on (none was lent while it was built); ``scripts/ops/gpu_check.sh`` runs it.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

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
                     "cuMemRelease", "cuMemAddressFree", "cuMemGetAllocationGranularity"):
            getattr(_driver, name).restype = ctypes.c_int
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        reason = text.value.decode() if text.value else f"CUresult {result}"
        raise ElasticFlowError(f"trainer.shard=parameters: the CUDA driver's {what} failed: {reason}",
                               "the GPU is out of memory, or its driver has no virtual memory management "
                               "(CUDA 10.2 or later); pass trainer.shard=gradients")


class _Reservation:
    """The vector's address range and the physical granules mapped into it. Held by the tensors over it (through
    ``_Array``), never by the vector: the tensors' memory goes when the last of them does, and no reference
    cycle runs through the C++ deleter that keeps it (the collector could not see such a cycle)."""

    def __init__(self, n: int, device: torch.device):
        self.device = device
        cu = _cuda()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.prop = _AllocationProp(type=_PINNED, location=_Location(type=_ON_DEVICE, id=index))
        self.access = _AccessDesc(location=_Location(type=_ON_DEVICE, id=index), flags=_READ_WRITE)
        granule = ctypes.c_size_t()
        _check(cu.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(self.prop),
                                                _GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        self.granule = int(granule.value)
        self.size = -(-max(1, n * FLOAT) // self.granule) * self.granule
        base = ctypes.c_uint64()
        _check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(self.size), ctypes.c_size_t(self.granule),
                                      ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.base = int(base.value)
        self.handles: List[int] = [0] * (self.size // self.granule)  # 0: unmapped

    def map(self, g: int) -> None:
        """Granule ``g`` backed by fresh physical memory (its contents: whatever that memory held)."""
        cu, handle = _cuda(), ctypes.c_uint64()
        result = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.granule), ctypes.byref(self.prop),
                                ctypes.c_uint64(0))
        if result == _OUT_OF_MEMORY:  # torch's caching allocator may hold free blocks: given back, then again
            torch.cuda.empty_cache()
            result = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.granule), ctypes.byref(self.prop),
                                    ctypes.c_uint64(0))
        _check(result, "cuMemCreate")
        address = ctypes.c_uint64(self.base + g * self.granule)
        _check(cu.cuMemMap(address, ctypes.c_size_t(self.granule), ctypes.c_size_t(0), handle, ctypes.c_uint64(0)),
               "cuMemMap")
        _check(cu.cuMemSetAccess(address, ctypes.c_size_t(self.granule), ctypes.byref(self.access),
                                 ctypes.c_size_t(1)), "cuMemSetAccess")
        self.handles[g] = int(handle.value)

    def unmap(self, g: int) -> None:
        cu = _cuda()
        _check(cu.cuMemUnmap(ctypes.c_uint64(self.base + g * self.granule), ctypes.c_size_t(self.granule)),
               "cuMemUnmap")
        _check(cu.cuMemRelease(ctypes.c_uint64(self.handles[g])), "cuMemRelease")
        self.handles[g] = 0

    def __del__(self) -> None:
        try:
            if any(self.handles):
                torch.cuda.synchronize(self.device)
            for g, handle in enumerate(self.handles):
                if handle:
                    self.unmap(g)
            _cuda().cuMemAddressFree(ctypes.c_uint64(self.base), ctypes.c_size_t(self.size))
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
        with torch.cuda.device(self.device):  # the driver calls act on the current context
            self._res = _Reservation(self.n, self.device)
            for g in range(len(self._res.handles)):
                self._res.map(g)
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
        with torch.cuda.device(self.device):
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
