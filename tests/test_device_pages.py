"""backends/torch/device_pages.py's failure paths, without a GPU: the CUDA driver is a fake that keeps a ledger of
what was created, mapped, reserved and retained, and fails the call a test names. A map that fails after
cuMemCreate gives its memory back; a vector whose build fails gives back everything; every call is made with the
device's context current. (A real driver: tests/test_gpu.py.)"""
from __future__ import annotations

import contextlib

import pytest
import torch

from elasticflow.backends.torch import device_pages
from elasticflow.errors import ElasticFlowError

GRANULE = 2 << 20
_INVALID_VALUE, _INVALID_CONTEXT = 1, 201


class FakeDriver:
    """libcuda.so's calls that device_pages makes. A call made with no context current fails, as
    CUDA_ERROR_INVALID_CONTEXT; ``fail``: {call name: the how-many-th call (1-based) that fails}."""

    def __init__(self, **fail):
        self.fail, self.counts = fail, {}
        self.created, self.released, self.mapped, self.reserved = [], [], {}, {}
        self.stack, self.retained, self.next_handle = [], 0, 100

    def _code(self, name, needs_context=True):
        self.counts[name] = self.counts.get(name, 0) + 1
        if needs_context and not self.stack:
            return _INVALID_CONTEXT
        return _INVALID_VALUE if self.fail.get(name) == self.counts[name] else 0

    def cuGetErrorString(self, code, text):
        text._obj.value = b"invalid argument" if code == _INVALID_VALUE else b"invalid device context"
        return 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = ordinal.value
        return self._code("cuDeviceGet", needs_context=False)

    def cuDevicePrimaryCtxRetain(self, context, device):
        code = self._code("cuDevicePrimaryCtxRetain", needs_context=False)
        if not code:
            self.retained += 1
            context._obj.value = 0xC0 + device.value
        return code

    def cuDevicePrimaryCtxRelease_v2(self, device):
        self.retained -= 1
        return 0

    def cuCtxPushCurrent_v2(self, context):
        self.stack.append(context.value)
        return 0

    def cuCtxPopCurrent_v2(self, context):
        self.stack.pop()
        return 0

    def cuMemGetAllocationGranularity(self, granule, prop, option):
        granule._obj.value = GRANULE
        return self._code("cuMemGetAllocationGranularity")

    def cuMemAddressReserve(self, base, size, alignment, addr, flags):
        code = self._code("cuMemAddressReserve")
        if not code:
            base._obj.value = 1 << 40
            self.reserved[base._obj.value] = size.value
        return code

    def cuMemCreate(self, handle, size, prop, flags):
        code = self._code("cuMemCreate")
        if not code:
            self.next_handle += 1
            handle._obj.value = self.next_handle
            self.created.append(self.next_handle)
        return code

    def cuMemMap(self, address, size, offset, handle, flags):
        code = self._code("cuMemMap")
        if not code:
            self.mapped[address.value] = handle.value
        return code

    def cuMemSetAccess(self, address, size, desc, count):
        return self._code("cuMemSetAccess")

    def cuMemUnmap(self, address, size):
        code = self._code("cuMemUnmap")
        if not code:
            del self.mapped[address.value]
        return code

    def cuMemRelease(self, handle):
        code = self._code("cuMemRelease")
        if not code:
            self.released.append(handle.value)
        return code

    def cuMemAddressFree(self, base, size):
        code = self._code("cuMemAddressFree")
        if not code:
            del self.reserved[base.value]
        return code

    def held(self):
        """What is still held: handles not released, granules mapped, ranges reserved, contexts retained."""
        return {"handles": sorted(set(self.created) - set(self.released)), "mapped": self.mapped,
                "reserved": self.reserved, "retained": self.retained, "pushed": self.stack}


NOTHING = {"handles": [], "mapped": {}, "reserved": {}, "retained": 0, "pushed": []}
GPU = torch.device("cuda", 0)


def _driver(monkeypatch, **fail) -> FakeDriver:
    fake = FakeDriver(**fail)
    monkeypatch.setattr(device_pages, "_driver", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return fake


@pytest.mark.parametrize("failing", ["cuMemMap", "cuMemSetAccess"])
def test_a_granule_whose_map_fails_after_cuMemCreate_gives_its_memory_back(monkeypatch, failing):
    fake = _driver(monkeypatch, **{failing: 2})  # the second granule's
    res = device_pages._Reservation(3 * GRANULE // 4, GPU)
    res.map(0)
    with pytest.raises(ElasticFlowError, match=f"the CUDA driver's {failing} failed: invalid argument") as err:
        res.map(1)
    assert "\n" not in err.value.message and "trainer.shard=gradients" in err.value.hint
    assert fake.released == [fake.created[1]] and list(fake.mapped.values()) == [fake.created[0]]
    assert res.handles == [fake.created[0], 0, 0]  # the failed granule unmapped, as it was
    res.map(1)  # and it can be tried again
    res.release()
    assert fake.held() == NOTHING


def test_a_vector_whose_build_fails_gives_back_every_granule_its_range_and_its_context(monkeypatch):
    fake = _driver(monkeypatch, cuMemCreate=3)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    with pytest.raises(ElasticFlowError, match="cuMemCreate failed"):
        device_pages.DeviceVector(5 * GRANULE // 4, GPU)
    assert len(fake.created) == 2 and fake.held() == NOTHING  # at once, not when the collector gets to it


def test_every_driver_call_is_made_with_the_gpus_context_current(monkeypatch):
    """A thread with no current context (one that never touched the GPU) gets CUDA_ERROR_INVALID_CONTEXT from
    the fake for any call made outside a context: each is made with the device's primary context pushed."""
    fake = _driver(monkeypatch)
    res = device_pages._Reservation(4 * GRANULE // 4, GPU)
    for g in range(4):
        res.map(g)
    res.unmap(2)
    res.map(2)
    assert fake.stack == [] and fake.retained == 1  # popped after each call; held for the vector's life
    res.release()
    res.release()  # idempotent: __del__ calls it again
    assert fake.held() == NOTHING


def test_no_context_on_the_gpu_is_refused_in_one_line(monkeypatch):
    fake = _driver(monkeypatch, cuDevicePrimaryCtxRetain=1)
    with pytest.raises(ElasticFlowError, match=r"cuDevicePrimaryCtxRetain \(cuda:0\) failed") as err:
        device_pages._Reservation(GRANULE // 4, GPU)
    assert "\n" not in err.value.message and "exclusive-process" in err.value.hint
    assert fake.held() == NOTHING
