"""An NCCL error raises into the recovery (distributed/comm/nccl.py), checked without a GPU: the environment a
worker's NCCL group is built under, the options it gets, and the bounded wait every NCCL operation ends with.
The same on a GPU: tests/test_gpu.py (a timed-out collective raises and the process goes on)."""
from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist

from elasticflow.distributed.comm import nccl
from elasticflow.distributed.comm.comm import Group
from elasticflow.distributed.protocol import CommError

NAMES = [*nccl.FORCED, *nccl.DEFAULTS]


class _Counting(dict):
    """An environment that counts its writes."""

    writes = 0

    def __setitem__(self, key, value):
        self.writes += 1
        super().__setitem__(key, value)


def test_the_error_handling_replaces_what_kills_the_process_and_keeps_an_operators_dump_settings():
    env = _Counting(TORCH_NCCL_ASYNC_ERROR_HANDLING="1", TORCH_NCCL_DUMP_ON_TIMEOUT="1")  # as torchrun leaves it
    assert nccl.environment(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": ""}
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}
    writes = env.writes
    assert nccl.environment(env) == {} and env.writes == writes  # again (Group's net): nothing written
    fresh = {}
    nccl.environment(fresh)
    assert fresh == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                     "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}


class _Options:
    _timeout = None


class _Work:
    def __init__(self, error=None):
        self.error, self.timeouts = error, []

    def wait(self, timeout=datetime.timedelta(0)):
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return True


class _FakeNCCL:
    """Stands in for ProcessGroupNCCL: records the environment and options it was built with."""

    built = []

    def __init__(self, store, rank, world, opts):
        self.environ = {n: os.environ.get(n) for n in NAMES}
        self.opts, self.aborts, self.work = opts, 0, _Work()
        _FakeNCCL.built.append(self)

    Options = _Options

    def eager_connect_single_device(self, device):
        self.device = device

    def allreduce(self, tensors, opts):
        return self.work

    def abort(self):
        self.aborts += 1


class _Stream:
    syncs = 0

    def synchronize(self):
        _Stream.syncs += 1


class _CudaTensor:
    """What allreduce_ reads of a GPU tensor."""
    is_cuda, device = True, "cuda:0"


@pytest.fixture
def nccl_groups(monkeypatch):
    """Two members' Groups of one generation: gloo for real (threads, one store), NCCL faked."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)  # restored after: environment() writes os.environ
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    _FakeNCCL.built = []
    store, groups = dist.HashStore(), [None, None]

    def build(rank):
        groups[rank] = Group(store, 3, rank, 2, timeout_s=7.5, nccl_device="cuda:0")

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(groups), "the gloo groups did not form"
    yield groups
    for g in groups:
        g.close(flush=False)


def test_a_workers_nccl_group_is_built_to_raise_and_every_operation_waits_with_the_timeout(nccl_groups):
    assert len(_FakeNCCL.built) == 2
    for pg in _FakeNCCL.built:
        assert pg.environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                              "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}
        assert pg.opts._timeout == datetime.timedelta(seconds=7.5)  # the watchdog's limit
    group, pg = nccl_groups[0], nccl_groups[0].nccl
    syncs = _Stream.syncs
    group.allreduce_(_CudaTensor())
    # wait() orders the stream, the stream's synchronize waits (until the watchdog's abort, at worst), and a wait
    # with the timeout raises if the work failed: without it, an operation aborted by the watchdog passed silently
    assert pg.work.timeouts == [datetime.timedelta(0), datetime.timedelta(seconds=7.5)]
    assert _Stream.syncs == syncs + 1


def test_an_nccl_error_in_a_collective_is_a_comm_error_and_aborts_the_communicator(nccl_groups):
    group = nccl_groups[0]
    pg = group.nccl
    pg.work = _Work(RuntimeError("NCCL error: remote process exited or there was a network error"))
    with pytest.raises(CommError, match="allreduce failed in generation 3: NCCL error: remote process exited"):
        group.allreduce_(_CudaTensor())
    assert pg.aborts == 1 and group.nccl is None and group.pg is None  # dropped: the next generation builds anew


def test_a_collective_that_completes_after_the_membership_thread_aborted_still_fails(nccl_groups):
    group = nccl_groups[1]
    group.abort()  # the agent published a generation without a member of this one
    with pytest.raises(CommError, match="aborted: a member of this generation left"):
        group.allreduce_(_CudaTensor())
