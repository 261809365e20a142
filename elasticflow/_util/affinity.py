"""Each CPU worker's training thread on a share of the host's cores of its own (``backend.pin_cores``), and how
many intra-op threads a worker runs by default (``cores``, ``default_threads``: the cores it may use and those
other processes keep busy).

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
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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


# ---------------------------------------------------------------- how many intra-op threads a worker runs
# A worker's intra-op threads (OpenMP's, MKL's) meet at a barrier after every parallel op, so one thread that
# another process keeps off its core stalls them all. Measured on a 2-core VM with two `while True: pass` hogs,
# digits CNN, 40 steps, median step: 2 threads 1.0-61 ms, 2 threads with OMP_WAIT_POLICY=PASSIVE 4.9-16 ms,
# 1 thread 1.0-1.1 ms (passive waiting made it worse: a thread that sleeps at the barrier waits for the
# scheduler to hand its core back). What helps is fewer threads than busy cores, so the default counts the
# cores other processes keep busy when the worker starts (scripts/bench/bench_threads.py).

@dataclass(frozen=True)
class Cores:
    """The cores a worker may use, as its default thread count sees them."""
    allowed: int                  # its CPU mask (os.sched_getaffinity), or os.cpu_count() without one
    limit: Optional[float] = None  # its cgroup's CPU quota in cores (cpu.max), None without one
    busy: float = 0.0             # cores other processes kept running when it looked (0: not looked, or placed)

    @property
    def usable(self) -> int:
        """The mask capped by the quota: threads beyond a quota are throttled, not run."""
        cap = self.allowed if self.limit is None else min(self.allowed, int(self.limit))
        return max(1, cap)

    @property
    def free(self) -> int:
        """The usable cores no other process holds, at least 1."""
        return max(1, min(self.usable, int(self.allowed - self.busy + 0.5)))

    def describe(self) -> str:
        quota = f", cgroup quota {self.limit:g}" if self.limit is not None else ""
        busy = f", {self.busy:g} threads of other processes running" if self.busy else ""
        return f"{self.allowed} core{'s' if self.allowed != 1 else ''} allowed{quota}{busy}"


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota, in cores, of this process's cgroup and the cgroups above it (the smallest), from cgroup v2's
    ``cpu.max`` ("200000 100000": 2 cores; "max 100000": none), else cgroup v1's ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``; None where there is no quota or no cgroup file to read."""
    try:
        lines = Path(own).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        parts = [p for p in path.strip().split("/") if p]
        if controllers == "":        # v2: one hierarchy, cpu.max in each cgroup on the path
            bases = [Path(root)]
            read = _v2_quota
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            bases = [Path(root) / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
            read = _v1_quota
        else:
            continue
        for base in bases:
            for depth in range(len(parts), -1, -1):
                limit = read(base.joinpath(*parts[:depth]))
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _v2_quota(folder: Path) -> Optional[float]:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> Optional[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def others_running(stat: str = "/proc/stat", samples: int = 8, gap_s: float = 0.0015) -> float:
    """Threads of other processes that kept running (or waiting for a core) throughout ``samples`` looks at the
    kernel's ``procs_running``, ``gap_s`` apart (~12 ms in all): the smallest count, less the looking thread, so a
    burst does not count and a busy loop does. The whole host's count."""
    counts = []
    for k in range(samples):
        try:
            text = Path(stat).read_text()
        except OSError:
            return 0.0
        counts += [int(line.split()[1]) for line in text.splitlines() if line.startswith("procs_running ")]
        if k + 1 < samples:
            time.sleep(gap_s)
    return float(max(0, min(counts) - 1)) if counts else 0.0


def cores(look: bool = True) -> Cores:
    """The cores this process may use; ``look``: also count those other processes keep busy (~12 ms).

    Only a process nobody placed looks (its mask is the whole host): one that SLURM's ``--cpu-bind``, taskset or
    a cpuset placed was given its cores, and the host's count says nothing of them.
    """
    online = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else online
    limit = cgroup_cpu_limit()
    busy = others_running() if look and allowed == online else 0.0
    return Cores(allowed, limit, busy)


def default_threads(share: int, host: Cores) -> int:
    """``backend.threads=null``: this worker's ``share`` of the host's cores (config/devices.intra_op_threads of
    ``host.usable``), and no more than the cores no other process holds."""
    return max(1, min(share, host.free))
