"""How the ranks of one save tell rank 0 that their shard is on disk.

Each rank ``report``s (ok, file, bytes, file and piece checksums) under the save's key; rank 0
``collect``s all W reports, bounded by a timeout, and only then commits. A member that died never
reports, so its save never commits -- and training goes on.

Store keys (the agent's TCPStore; every value sealed with the job token, _util/sealing.py):
    ckpt/job/<tag>              the job directory every worker of the run uses (first writer wins; <tag> is
                                derived from the token, so a stranger cannot take the slot first)
    ckpt/token/<tag>            a random token naming this run's temporary directories
    ckpt/<token>/<save>/rank<r> JSON report of rank r for one save
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Collection, Dict, List, Optional

from ..errors import ElasticFlowError
from .._util import untrusted
from .._util.sealing import REFUSED, Forged, Sealer


AGREE_TRIES = 12  # 0.2 s apart: the agent's health round (0.1 s) puts an agreed value back well within


class CollectTimeout(Exception):
    """Not every rank reported in time; ``missing`` lists the ranks that did not. ``left``: each of them left the
    job (the agent declared it gone), so its report would never have come."""

    def __init__(self, missing: List[int], waited_s: float, left: bool = False):
        ranks = ", ".join(map(str, missing))
        super().__init__(f"rank(s) {ranks} left the job before reporting" if left else
                         f"rank(s) {ranks} did not report within {waited_s:g}s")
        self.missing = missing


def NOBODY_GONE() -> Collection[int]:
    """``collect``'s default ``gone``: no rank of the save left."""
    return ()


class Coordinator:
    """The interface: ``report`` from every rank, ``collect`` on rank 0. Called from the writer thread."""

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        raise NotImplementedError

    def collect(self, key: str, world: int, timeout_s: float,
                gone: Callable[[], Collection[int]] = NOBODY_GONE) -> List[Dict[str, Any]]:
        """Every rank's report, in rank order; CollectTimeout once ``timeout_s`` passed, or once every rank still
        missing is in ``gone()`` (ranks of the save that left the job: no report will come)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Offline(Coordinator):
    """For a save made while the agent's store cannot be reached (``CheckpointManager.save``): each rank's report
    is only the file it leaves beside its shard, and rank 0 cannot collect them, so the save is finished from the
    files later (finish.py)."""

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        pass

    def collect(self, key: str, world: int, timeout_s: float,
                gone: Callable[[], Collection[int]] = NOBODY_GONE) -> List[Dict[str, Any]]:
        raise ConnectionError("the agent's store cannot be reached")


class LocalCoordinator(Coordinator):
    """In-memory, for single-process runs (W=1) and for tests that run W writers as threads."""

    def __init__(self):
        self._reports: Dict[str, Dict[int, Dict[str, Any]]] = {}
        self._cond = threading.Condition()

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        with self._cond:
            self._reports.setdefault(key, {})[rank] = value
            self._cond.notify_all()

    def collect(self, key: str, world: int, timeout_s: float,
                gone: Callable[[], Collection[int]] = NOBODY_GONE) -> List[Dict[str, Any]]:
        deadline = time.monotonic() + timeout_s  # (in one process nobody leaves: ``gone`` is not read)
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
    """Through the agent's store, on a client of its own (``connect()`` makes one: Membership.new_client).

    The connection is opened here, as the worker joins, not at the first save: a store that is hard to reach
    later (a stranger crowding its door, docs/security.md) must not cost the job its checkpoints. Only if it
    fails here is it tried again at the first use.

    Note: store clients are not thread-safe, and the training thread uses the membership's; this
    one is used from the thread that first uses it (the checkpoint writer thread) only.
    """

    POLL_S = 0.02  # polling ``check`` rather than ``wait``: a timed-out wait logs C++ warnings

    def __init__(self, connect: Callable[[], Any], sealer: Sealer):
        self.connect, self.sealer = connect, sealer
        self._owner: Optional[int] = None
        try:
            self._store = connect()
        except Exception:  # noqa: BLE001 - the save that needs it reports the failure (and its rank's report)
            self._store = None

    def _client(self):
        if self._store is None:
            self._store = self.connect()
        if self._owner is None:
            self._owner = threading.get_ident()
        assert self._owner == threading.get_ident(), "StoreCoordinator used from two threads"
        return self._store

    def report(self, key: str, rank: int, value: Dict[str, Any]) -> None:
        k = f"{key}/rank{rank}"
        self._client().set(k, self.sealer.seal(k, json.dumps(value)))

    def collect(self, key: str, world: int, timeout_s: float,
                gone: Callable[[], Collection[int]] = NOBODY_GONE) -> List[Dict[str, Any]]:
        """Every rank's report; a forged one (a stranger's) is refused and waited past, never removed: the
        rank's own report may land between our read and a delete, which would then lose it. Gives up as soon
        as every rank still missing left the job (``gone``), not ``timeout_s`` later."""
        store = self._client()
        keys = [f"{key}/rank{r}" for r in range(world)]
        got: Dict[int, Dict[str, Any]] = {}
        forged: Dict[int, bytes] = {}  # the forgery last refused at each rank's key: counted once
        started = time.monotonic()
        deadline = started + timeout_s
        while len(got) < world:
            for r, k in enumerate(keys):
                raw = None if r in got else untrusted.read(store, k)  # never check-then-get: a delete between
                if raw is None:
                    continue
                try:
                    report = untrusted.loads(self.sealer.open(k, raw))
                except (Forged, ValueError) as exc:
                    if forged.get(r) != raw:
                        REFUSED("checkpoint report", str(exc))
                        forged[r] = raw
                    continue
                if isinstance(report, dict):
                    got[r] = report
            if len(got) < world:
                missing = [r for r in range(world) if r not in got]
                if set(missing) <= set(gone()):
                    raise CollectTimeout(missing, time.monotonic() - started, left=True)
                if time.monotonic() > deadline:
                    raise CollectTimeout(missing, timeout_s)
                time.sleep(self.POLL_S)
        for k in keys:  # keep the store small over a long run
            store.delete_key(k)
        return [got[r] for r in range(world)]

    def close(self) -> None:
        self._store = None


def agree(store, key: str, candidate: str, sealer: Optional[Sealer] = None,
          valid: Callable[[str], bool] = lambda value: True) -> str:
    """The value every worker of the run agrees on: the first candidate offered wins (atomic).

    The slot's name carries a tag only token holders compute, and its value is sealed: a value that does not
    verify, or is not ``valid``, is refused and removed, and the slot taken again."""
    if store is None:
        return candidate
    slot = f"{key}/{sealer.name(key)}"
    for attempt in range(AGREE_TRIES):
        raw = store.compare_set(slot, "", sealer.seal(slot, candidate))
        try:
            value = sealer.open(slot, raw)
            if valid(value):
                return value
            raise Forged(f"{value[:80]!r} is not a valid {key}")
        except Forged as exc:
            REFUSED("checkpoint job", str(exc))
            # The agent puts the agreed value back within its health round (Health.reassert); only a slot
            # nobody agreed on yet stays forged, and is cleared for ours.
            time.sleep(0.2)
            if attempt == AGREE_TRIES - 2:
                store.delete_key(slot)
    raise ElasticFlowError(f"the workers could not agree on {key}: someone keeps writing it",
                           "a process that can reach the job's store but has no token is interfering; run the "
                           "job on a private network (docs/multi-host.md, the trust boundary)")


def plain_name(value: str) -> bool:
    """A folder name to use under checkpoint.dir: no separators, no '..', no control characters."""
    return 0 < len(value) <= 255 and value not in (".", "..") and "/" not in value and "\\" not in value and \
        value.isprintable()


def store_alive(store) -> bool:
    """Whether the agent's store still answers (a dead agent's store fails at once)."""
    try:
        store.check(["gen/current"])
        return True
    except Exception:  # noqa: BLE001 - any failure means no coordinated save is possible
        return False
