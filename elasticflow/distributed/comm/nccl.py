"""What an NCCL error does in a worker (``comm.backend=nccl``): it raises into the recovery, as gloo's do.

torch's ProcessGroupNCCL runs a watchdog thread per group. By default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``)
the watchdog, on an NCCL error (a dead peer, a broken link) or on a collective older than the group's timeout,
rethrows the error in its own thread, which ends the process (std::terminate, SIGABRT); a survivor of a dead
peer then dies as well, and its step is not redone but restarted by the agent. So a worker sets, before its
first NCCL group reads them (``environment``, called by the worker's main and again by ``comm.Group``):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly), always, replacing whatever the environment held (torchrun
  sets 1): the watchdog aborts the group's communicators (a kernel spinning for a dead peer returns, the GPU is
  free) and records the error, and the process lives. 1 (TearDown) and 3 (SkipCleanUp) end the process; 0
  (NoHandling) leaves a timed-out collective nobody waits for spinning on the GPU.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: otherwise the first NCCL group of the process (uid 0: the first generation
  this worker was in) has its heartbeat monitor poll the job's store every second for a flight-recorder dump
  signal (the store's root, under PrefixStore's prefixes; each poll takes the GIL for our store's client), and on
  one (which the watchdog writes there on any error, for every worker to read) dump, sleep
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (8 min) and end the process; closing that group meanwhile joins the
  monitor, so waits as long.
- ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=0``: the watchdog sleeps 4x this (60 s by default) after an error, to
  let a dump finish, before it aborts; dropping the failed group joins the watchdog, so the recovery would wait.

The last two only where the environment does not set them (an operator debugging a hang may want the dumps).
The heartbeat monitor itself stays (``TORCH_NCCL_ENABLE_MONITORING``): it ends a process whose watchdog is
stuck in a CUDA call for 8 minutes, which the agent then replaces like any dead worker.

Each NCCL operation then ends in ``finish``: ``Work.wait()`` orders the current stream after it and the stream's
synchronize waits for it, as before; with handling 2 that wait ends even when a peer is dead or the operation is
past the group's timeout (the watchdog aborts the communicator, and the kernel returns), and so does the abort the
membership thread makes. A second ``Work.wait(timeout)``, now that the operation is over, raises if it failed (an
aborted communicator is an error; torch aborts it first where it has not been), which ``Group`` turns into a
CommError. Not ``Work.wait(timeout)`` alone: it polls the work every 1-10 ms (torch's kSynchronizeBusyWaitMillis),
a delay on every one of a step's NCCL operations.

Note: desk-checked against torch's ProcessGroupNCCL.cpp (WorkNCCL::wait, the Watchdog and HeartbeatMonitor run
loops); ``tests/test_gpu.py`` checks it on a GPU (a timed-out collective raises and the process goes on).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Dict, MutableMapping, Optional

import torch

FORCED = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
DEFAULTS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"}


def environment(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set NCCL's error handling in ``environ`` (this process's environment by default); returns what it changed,
    name -> the value it replaced ("" where unset). Writes nothing where the values are already there: a second
    call, from another thread, changes no environment under a reader."""
    environ = os.environ if environ is None else environ
    changed = {}
    for name, value in FORCED.items():
        if environ.get(name) != value:
            changed[name] = environ.get(name, "")
            environ[name] = value
    for name, value in DEFAULTS.items():
        if name not in environ:
            changed[name] = ""
            environ[name] = value
    return changed


def options(timeout_s: float, cls: Any = None) -> Any:
    """``ProcessGroupNCCL.Options`` with the group's timeout: the watchdog's limit for every operation (it aborts
    the communicator past it), as ``finish`` is the waiting thread's."""
    cls = cls or torch.distributed.ProcessGroupNCCL.Options
    opts = cls()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return opts


def finish(work: Any, device: torch.device, timeout_s: float, aborted: Callable[[], bool]) -> None:
    """Wait for an NCCL operation and the device: a failure or a timeout raises here, not at some later sync point.
    ``aborted``: whether the membership thread aborted the group meanwhile (a member left), which fails the
    operation even where it seemed to complete."""
    work.wait()  # orders the current stream after the operation; the host does not wait here
    # A sync point, as float(loss) is anyway. Bounded: the watchdog aborts a failed or timed-out operation's
    # communicator (handling 2), and the membership thread one whose member the agent declared gone.
    torch.cuda.current_stream(device).synchronize()
    # Over now: raises if it failed or was aborted (the timeout only bounds a work torch still sees running).
    work.wait(datetime.timedelta(seconds=timeout_s))
    if aborted():
        raise RuntimeError("NCCL communicator aborted: a member of this generation left")
