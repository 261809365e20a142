"""A worker slowed on purpose by `elasticflow inject RUN --slow R --factor F` (distributed/agent/inject.py).

Each step the worker polls one record, ``worker/<id>/drill`` (``Drills``: at most once a second), and when a drill
was asked reads its ``worker/<id>/slow`` record (sealed by the agent); while one is in force it sleeps (F - 1) x
the time its micro-batches just took, so that it computes F times slower, as a slow device would: the sleep is
before the step's reduction, counted in the time per micro-batch the members measure (train/balance.py: a
rebalance deals it fewer micro-batches, ``evict`` cuts it out), and its peers wait for it in the reduction.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from .._util.fileio import append_event
from ..distributed import protocol
from ..distributed.agent.inject import drill_key, slow_key

log = logging.getLogger("elasticflow")
READ_S = 1.0  # how often the drills' record is read: one store round trip a second per worker, nothing in between


class Drills:
    """The one record a worker polls for `elasticflow inject`'s drills (``worker/<id>/drill``: the nonce of the
    newest, sealed by the agent), at most once every READ_S: ``changes`` counts its changes, and each drill
    (``Slowdown``, ``fingerprint.Flips``) reads its own record only when the count moved past the one it saw.
    ``membership``: the worker's (None: one worker in-process, asked nothing).

    ``poll()`` runs after a step's commit only, never before its reduction: with the agent cut off (a partition) a
    store read waits out its timeout, and before the reduction it kept the worker from the collective whose
    failure the recovery starts from (tests/test_hosts.py's partition)."""

    def __init__(self, membership: Any):
        self.m, self.seen, self.changes, self.next_read = membership, None, 0, 0.0

    def poll(self) -> int:
        m, now = self.m, time.monotonic()
        if m is None or getattr(m, "worker_id", None) is None or now < self.next_read:
            return self.changes
        self.next_read = now + READ_S
        try:
            nonce = protocol.fetch(m.store, m.sealer, drill_key(m.worker_id), "drill")
        except Exception:  # noqa: BLE001 - the agent is gone: the membership's own calls say so
            return self.changes
        if nonce is not None and nonce != self.seen:
            self.seen, self.changes = nonce, self.changes + 1
        return self.changes


class Slowdown:
    """``compute(seconds)`` sleeps as the agent's record says. ``drills``: the worker's ``Drills``."""

    def __init__(self, membership: Any, drills: Drills):
        self.m, self.drills, self.version = membership, drills, 0
        self.factor, self.until, self.nonce = 1.0, None, None
        self.slept, self.steps = 0.0, 0

    def compute(self, seconds: float, rank: int) -> None:
        """The micro-batches of this step took ``seconds``: sleep to make them F times as long, if asked."""
        if self.drills.changes != self.version:
            self.version = self.drills.changes
            self._read(seconds, rank)
        if self.factor > 1.0 and self.until is not None and time.time() > self.until:
            self._set(1.0, None, rank, seconds)
        if self.factor > 1.0:
            pause = seconds * (self.factor - 1.0)
            self.slept, self.steps = self.slept + pause, self.steps + 1
            time.sleep(pause)

    def _read(self, seconds: float, rank: int) -> None:
        try:
            record = protocol.fetch_json(self.m.store, self.m.sealer, slow_key(self.m.worker_id), "slowdown")
        except Exception:  # noqa: BLE001 - the agent is gone: the membership's own calls say so
            return
        if record is not None and record.get("nonce") != self.nonce:
            self.nonce = record.get("nonce")
            self._set(float(record.get("factor", 1.0)), record.get("until"), rank, seconds)

    def _set(self, factor: float, until: Optional[float], rank: int, seconds: float) -> None:
        if self.factor > 1.0:  # the slowdown in force ends
            self._event("slowed_end", rank, factor=self.factor, steps=self.steps, slept_s=round(self.slept, 4))
        self.factor, self.until, self.slept, self.steps = factor, until, 0.0, 0
        if factor > 1.0:
            log.warning("inject: worker %s (rank %d) slowed %gx%s", self.m.worker_id, rank, factor,
                        f" for {until - time.time():.0f}s" if until else "")
            self._event("slowed", rank, factor=factor, compute_s=round(seconds, 6),
                        sleep_s=round(seconds * (factor - 1.0), 6))

    def _event(self, kind: str, rank: int, **fields: Any) -> None:
        events = getattr(self.m, "events", None)
        if events is not None:
            append_event(events, kind, "worker", worker=self.m.worker_id, rank=rank, **fields)
