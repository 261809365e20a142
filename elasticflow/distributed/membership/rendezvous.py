"""The agent's view of the newest generation while its group forms, and when to give up on it.

A generation goes through three phases, each visible in the store (protocol.py lists the keys):
every member *arrives* (it is ready to build, no longer busy in an older generation), every member
builds the gloo group, every member reports it *formed*. Workers start the gloo build only once all
have arrived, so no member spends its rendezvous timeout waiting for a peer that is still finishing
an older generation -- the cascade that used to lose whole jobs.

The agent, not the workers, decides that a generation failed to form, and then supersedes it:
- a member reports that building the group failed (others get ``REPORT_WINDOW_S`` to report too);
- a member has not arrived ``elastic.timeout_s`` after the publish;
- every member arrived, yet the group neither formed nor failed within ``elastic.timeout_s``
  (gloo's own connect timeout) plus the report window;
- after forming, every member reported a failed collective and nobody left (nothing else would
  publish a new generation).
The next generation keeps the members that reported or arrived; the others wait for a later one.
Repeated failures back off (``backoff_s``), but never give up: only launcher.min_workers stops a job.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import protocol
from typing import List, Optional, Set

REPORT_WINDOW_S = 0.5  # after the first report of a failed build, how long the other members have to report
# Up to this many members, each reads every member's arrival itself (the quickest); beyond, each waits for the
# agent's one ``gen/<g>/go``: N members reading N arrivals each was N² reads a generation (256 members: 5 s).
DIRECT_ARRIVALS = 32
BACKOFF_FIRST_S = 0.25  # the second failure in a row waits this long before the next publish; doubles after
# Failure reports are read when gen/<g>/failures moved (every report counts there) and at least this often (the
# count is anyone's to write or delete, on a store=tcp): not every member's key every round, N reads a round
# (1,024 members: 10k a second; a sweep every second was still a third of the agent's reads)
SWEEP_S = 5.0


@dataclass
class Verdict:
    """What became of the forming generation: "formed", or "failed" with the members to keep."""
    outcome: str
    generation: int
    after_s: float                     # since the publish
    keep: Set[int] = field(default_factory=set)
    cause: str = ""


def key(g: int, what: str, worker_id: int) -> str:
    """gen/<g>/arrived|formed|failed/<id>: a member's progress through generation g (see protocol.py)."""
    return f"gen/{g}/{what}/{worker_id}"


def go_key(g: int) -> str:
    """gen/<g>/go: the agent saw every member of generation g arrive."""
    return f"gen/{g}/go"


def failures_key(g: int) -> str:
    """gen/<g>/failures: how many failure reports generation g's members wrote (a hint, not trusted)."""
    return f"gen/{g}/failures"


POLLS_PER_S = 4000  # what a generation's waiting members ask of the store together, at most (above 20 members)


def poll_s(members: int) -> float:
    """How often a member polls the store while it waits on its generation: 5 ms, longer in a large one (every
    member's poll lands on the one store), up to 0.1 s."""
    return min(0.25, max(0.005, members / POLLS_PER_S))


class Rendezvous:
    """Tracks one generation at a time: ``opened`` at each publish, ``poll``ed every health tick."""

    def __init__(self, store, timeout_s: float, sealer):
        self.store, self.timeout_s, self.sealer = store, timeout_s, sealer
        self.generation = -1
        self.ids: List[int] = []
        self.phase = "none"            # arriving | building | formed | failed
        self.published_at = 0.0
        self.arrived_at: Optional[float] = None
        self.first_report: Optional[float] = None
        self.failures = 0              # generations in a row that failed to form
        self._reports: Set[int] = set()  # the newest read of the members that reported a failure ...
        self._reports_at, self._swept_at = -1.0, float("-inf")  # ... when, and when every key was last read
        self._count: Optional[int] = 0    # ... and gen/<g>/failures then

    @property
    def forming(self) -> bool:
        return self.phase in ("arriving", "building")

    def opened(self, g: int, ids: List[int], now: float) -> None:
        self.generation, self.ids, self.phase, self.published_at = g, list(ids), "arriving", now
        self.arrived_at = self.first_report = None
        self._reports, self._reports_at, self._swept_at, self._count = set(), -1.0, float("-inf"), 0

    def backoff_s(self) -> float:
        """How long to wait before publishing the generation that replaces a failed one."""
        if self.failures <= 1:
            return 0.0  # the first failure is retried at once: most are a single dead or stuck member
        return min(BACKOFF_FIRST_S * 2 ** (self.failures - 2), self.timeout_s)

    def _with(self, what: str, ids: List[int]) -> Set[int]:
        # One round trip per member: read only where a cheaper read said it is needed (``_all``, ``reports``).
        # A record that does not verify (a stranger's) counts as absent (protocol.fetch refuses it).
        return {i for i in ids if protocol.fetch(self.store, self.sealer, key(self.generation, what, i), "arrival")
                is not None}

    def _all(self, what: str, ids: List[int]) -> bool:
        """Whether every member wrote ``what``: one round trip (``check``) while some have not, then each record's
        seal read once."""
        return self.store.check([key(self.generation, what, i) for i in ids]) and self._with(what, ids) == set(ids)

    def reports(self, now: float, ids: List[int]) -> Set[int]:
        """The members of ``ids`` that reported a failed collective or build; read once a round at most, and
        every member's key only when gen/<g>/failures moved, some have reported, or SWEEP_S has passed."""
        if now == self._reports_at:
            return self._reports & set(ids)
        count = protocol.counter(self.store, failures_key(self.generation), "failures")
        if self._reports or count != self._count or now - self._swept_at >= SWEEP_S:
            self._reports, self._swept_at, self._count = self._with("failed", ids), now, count
        self._reports_at = now
        return self._reports & set(ids)

    def poll(self, now: float, ids: List[int]) -> Optional[Verdict]:
        """``ids``: the generation's members still alive. Returns a verdict once, when there is one."""
        if self.phase not in ("arriving", "building", "formed") or not ids:
            return None
        after = now - self.published_at
        failed = self.reports(now, ids)
        if self.phase == "formed":
            if failed == set(ids):
                return self._fail(after, set(ids), f"every member's collective failed in generation {self.generation}")
            return None
        if self._all("formed", ids):
            self.phase, self.failures = "formed", 0
            return Verdict("formed", self.generation, after)
        if failed:
            formed = self._with("formed", ids)
            self.first_report = self.first_report or now
            if set(ids) - failed - formed and now - self.first_report < REPORT_WINDOW_S:
                return None
            return self._fail(after, failed | formed, f"building the group failed on worker(s) {sorted(failed)}")
        if self.phase == "arriving":
            if not self._all("arrived", ids):
                if after > self.timeout_s:
                    arrived = self._with("arrived", ids)
                    late = sorted(set(ids) - arrived)
                    return self._fail(after, arrived, f"worker(s) {late} did not arrive within "
                                                      f"elastic.timeout_s={self.timeout_s:g}s")
                return None
            self.phase, self.arrived_at = "building", now
            protocol.put(self.store, self.sealer, go_key(self.generation), "1")
        if now - self.arrived_at > self.timeout_s + REPORT_WINDOW_S:
            return self._fail(after, self._with("formed", ids), f"the group neither formed nor failed within "
                                                                f"elastic.timeout_s={self.timeout_s:g}s of every "
                                                                "member arriving")
        return None

    def _fail(self, after: float, keep: Set[int], cause: str) -> Verdict:
        self.phase = "failed"
        self.failures += 1
        return Verdict("failed", self.generation, after, keep, cause)
