"""How the ranks of one save tell rank 0 that their shard is on disk.

Each rank ``report``s (ok, file, bytes, file and piece checksums) under the save's key; rank 0
``collect``s all W reports, bounded by a timeout, and only then commits. A member that died never
reports, so its save never commits -- and training goes on.

Store keys (the agent's TCPStore):
    ckpt/job                    the job directory every worker of the run uses (first writer wins)
    ckpt/token                  a random token naming this run's temporary directories
    ckpt/<token>/<save>/rank<r> JSON report of rank r for one save
"""
from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Any, Dict, List, Optional


class CollectTimeout(Exception):
    """Not every rank reported in time; ``missing`` lists the ranks that did not."""

    def __init__(self, missing: List[int], waited_s: float):
        super().__init__(f"rank(s) {', '.join(map(str, missing))} did not report within {waited_s:g}s")
        self.missing = missing


class Coordinator:
    """The interface: ``report`` from every rank, ``collect`` on rank 0. Called from the writer thread."""

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        raise NotImplementedError

    def collect(self, key: str, world: int, timeout_s: float) -> List[Dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalCoordinator(Coordinator):
    """In-memory, for single-process runs (W=1) and for tests that run W writers as threads."""

    def __init__(self):
        self._reports: Dict[str, Dict[int, Dict[str, Any]]] = {}
        self._cond = threading.Condition()

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        with self._cond:
            self._reports.setdefault(key, {})[rank] = value
            self._cond.notify_all()

    def collect(self, key: str, world: int, timeout_s: float) -> List[Dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._reports.get(key, {})) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    have = self._reports.get(key, {})
                    raise CollectTimeout([r for r in range(world) if r not in have], timeout_s)
                self._cond.wait(left)
            got = self._reports.pop(key)
        return [got[r] for r in range(world)]


class StoreCoordinator(Coordinator):
    """Through the agent's TCPStore, on a client of its own.

    Note: TCPStore clients are not thread-safe, and the training thread uses the membership's; this
    one connects lazily in the thread that first uses it (the checkpoint writer thread) and is
    used from there only.
    """

    POLL_S = 0.02  # polling ``check`` rather than ``wait``: a timed-out wait logs C++ warnings

    def __init__(self, address: str, timeout_s: float):
        self.address, self.timeout_s = address, timeout_s
        self._store = None
        self._owner: Optional[int] = None

    def _client(self):
        from torch.distributed import TCPStore

        if self._store is None:
            host, port = self.address.rsplit(":", 1)
            self._store = TCPStore(host, int(port), None, False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
            self._owner = threading.get_ident()
        assert self._owner == threading.get_ident(), "StoreCoordinator used from two threads"
        return self._store

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        self._client().set(f"{key}/rank{rank}", json.dumps(value))

    def collect(self, key: str, world: int, timeout_s: float) -> List[Dict[str, Any]]:
        store = self._client()
        keys = [f"{key}/rank{r}" for r in range(world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise CollectTimeout([r for r, k in enumerate(keys) if not store.check([k])], timeout_s)
            time.sleep(self.POLL_S)
        out = [json.loads(store.get(k)) for k in keys]
        for k in keys:  # keep the store small over a long run
            store.delete_key(k)
        return out

    def close(self) -> None:
        self._store = None


def agree(store, key: str, candidate: str) -> str:
    """The value every worker of the run agrees on: the first candidate offered wins (atomic)."""
    if store is None:
        return candidate
    value = store.compare_set(key, "", candidate)
    return value.decode() if isinstance(value, bytes) else str(value)


def store_alive(store) -> bool:
    """Whether the agent's store still answers (a dead agent's store fails at once)."""
    try:
        store.check(["gen/current"])
        return True
    except Exception:  # noqa: BLE001 - any failure means no coordinated save is possible
        return False
