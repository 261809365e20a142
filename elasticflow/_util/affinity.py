"""Each CPU worker's training thread on a share of the host's cores of its own (``backend.pin_cores``).

Only the training thread is pinned. gloo's transport and run-loop threads stay free to run on any core:
pinning each whole worker to its core was slower (gloo's thread then waits behind its own training
thread). Pinning the training threads alone made 2 workers on 2 cores clearly faster than torchrun + DDP,
where unpinned they were about even (scripts/bench/bench_elastic.py; the figures are in docs/benchmarks.md,
"Multi-worker throughput", and the A/B runs in docs/benchmarks/history.md, "pin-cores").

A thread starts with the CPU mask of the thread that starts it, so threads started by the pinned
training thread call :func:`release` first (the data and checkpoint pools), and a new gloo group is
built :func:`unpinned` (its threads are started in C++). A thread a model file starts itself keeps the
worker's share.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import List, Optional, Sequence

log = logging.getLogger(__name__)
_free: Optional[set] = None  # the cores this process may use, saved when the training thread was pinned


def share(cores: Sequence[int], slot: int, local_workers: int) -> Optional[List[int]]:
    """The cores of worker ``slot``'s share when ``local_workers`` (2 or more) split ``cores`` evenly with
    at least one each; None when there is nothing to split (one worker, more workers than cores, or a
    slot past the workers the host was started with: a replacement or a scale-up)."""
    cores = sorted(cores)
    if local_workers < 2 or len(cores) < local_workers or not 0 <= slot < local_workers:
        return None
    k = len(cores) // local_workers
    return cores[slot * k:(slot + 1) * k]


def host_share(slot: int, local_workers: int) -> Optional[List[int]]:
    """:func:`share` of the cores this process may use, unless someone already placed it (SLURM's
    ``--cpu-bind``, taskset, a cgroup's cpuset: fewer cores allowed than the host has); Linux only."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if len(allowed) != os.cpu_count():
        return None
    return share(list(allowed), slot, local_workers)


def pin_training_thread(slot: int, local_workers: int) -> Optional[List[int]]:
    """Pin the calling thread to worker ``slot``'s :func:`host_share`, if it has one; returns the cores."""
    cores = host_share(slot, local_workers)
    if cores:
        pin(cores)
        log.debug("training thread pinned to cores %s", cores)
    return cores


def pin(cores: Sequence[int]) -> None:
    """Keep the calling thread (the training thread) on ``cores``."""
    global _free
    if _free is None:
        _free = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)


def release() -> None:
    """Let the calling thread run on every core the process may use (a pool's initializer: the pool's
    threads were started by the pinned training thread)."""
    if _free is not None:
        os.sched_setaffinity(0, _free)


@contextmanager
def unpinned():
    """Threads started inside (by C++ code: gloo's, when a group is built) may use every core."""
    if _free is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _free)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
