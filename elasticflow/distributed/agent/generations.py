"""Publishing generations: when the next one is due, and writing it.

Membership is a generation number plus the member list in rank order. At every change the agent publishes the
next generation in the store (its record, then ``gen/current`` naming it) and rewrites RUN_DIR/workers.json;
survivors keep their relative order, so ranks stay dense. A generation that fails to form (membership/rendezvous.py says
when; health.py acts on it) is superseded by the next one after a back-off; joiners admitted while a generation
forms enter the next one together. Below ``launcher.min_workers`` the agent waits ``elastic.wait_s``, then
publishes a "stop" generation.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

from .. import protocol
from ..membership.rendezvous import Rendezvous
from . import workers_json
from .state import AgentState

log = logging.getLogger("elasticflow")


class Generations:
    """The generations of the job in ``state``, announced through ``rdv`` (which then watches each form).
    Owns when the job fell below launcher.min_workers."""

    def __init__(self, state: AgentState, rdv: Rendezvous):
        self.state, self.rdv = state, rdv
        self.below_min_since: Optional[float] = None

    def publish(self, action: str = "train", reason: str = "") -> None:
        """Announce the next generation with the current members (admitted joiners enter now)."""
        state = self.state
        for w in state.admitted:
            w.hb_seen = time.monotonic()
        if state.generation < 0:  # the first generation ranks workers by id, not by who was quicker
            state.admitted.sort(key=lambda w: w.id)
        state.roster.move_all(state.admitted, "members")
        # The pids of those who came or went, for the new rank 0's console line (never every member's: the
        # record is read by each of them, and a 1,000-worker job's would grow by ~20 kB a generation).
        before, after = {w.id: w for w in state.published}, {w.id: w for w in state.members}
        changed = {i: w.pid for i, w in {**before, **after}.items() if (i in before) != (i in after)}
        pids = changed if state.generation >= 0 else {}
        state.published = list(state.members)
        self.announce([w.id for w in state.members], [w.id for w in state.waiting], action, reason, state.gone,
                      pids, {i: c for i, c in state.causes.items() if i in state.gone})
        state.gone, state.causes = [], {}
        state.dirty = False
        state.supersede_at = None
        workers_json.write(state, action)

    def announce(self, ids: List[int], waiting: List[int], action: str, reason: str, gone: List[int] = (),
                 pids: Optional[Dict[int, int]] = None, causes: Optional[Dict[int, str]] = None) -> None:
        """Write the next generation's record and name it current; the one still forming is superseded."""
        state, rdv = self.state, self.rdv
        now = time.monotonic()
        state.generation += 1
        g = state.generation
        if rdv.forming:  # replaced before it formed: a member left, or the job stops
            state.event("superseded", generation=rdv.generation, cause=reason or "a member left while it formed",
                        after_s=round(now - rdv.published_at, 3), waiting=[], retry_in_s=0)
        # The generation's record goes in before gen/current names it: a worker reads them in that order.
        state.put(protocol.generation_key(g), protocol.encode(ids, action, reason, waiting, gone, pids, causes))
        state.put("gen/current", str(g))
        rdv.opened(g, ids, now)
        state.event("generation", generation=g, members=ids, waiting=waiting, action=action, reason=reason)

    def end_stragglers(self) -> None:
        """Training finished while a generation formed (a joiner admitted in the last steps): its members
        can never meet, the others are done. An empty "stop" generation tells every worker still waiting
        for one to exit (membership.Removed, code 5) -- a remote one too, with no signal to carry."""
        self.announce([], [], "stop", "training finished before this generation formed")

    def maybe_publish(self, now: float) -> None:
        """Publish the next generation if one is due: the first once its workers are in, then at every change
        (after the back-off, for a successor of one that failed), or "stop" after too long below min_workers."""
        state = self.state
        lc, el = state.cfg.launcher, state.cfg.elastic
        if state.trained:
            return  # the job is over: no generation can form any more
        if state.generation < 0:
            # The first generation waits for every initial worker, on every host launcher.nodes names (or
            # min_workers after wait_s); on Kubernetes, for min_workers pods: the rest join as they are placed.
            ready = len(state.admitted)
            initial = {"nodes": lc.nodes * lc.procs_per_node, "kubernetes": lc.min_workers}.get(lc.name, 0)
            every = not state.joining and ready >= initial
            if ready and (every or (now - state.started > el.wait_s and ready >= lc.min_workers)):
                self.publish()
            return
        if not (state.members or state.admitted):
            return
        if state.supersede_at is not None:
            if now < state.supersede_at and not state.dirty:
                return  # back-off after repeated failures to form
        elif not state.dirty and (not state.admitted or self.rdv.forming):
            return  # joiners admitted while a generation forms enter the next one, together
        if len(state.members) + len(state.admitted) >= lc.min_workers:
            if self.below_min_since is not None:
                self._below_min_ended(now, "resumed")
            self.publish(reason=state.supersede_cause if state.supersede_at is not None else "")
            return
        if self.below_min_since is None:
            self.below_min_since = now
            log.warning("%d worker(s) left, fewer than launcher.min_workers=%d; waiting up to elastic.wait_s=%gs",
                        len(state.members), lc.min_workers, el.wait_s)
        elif now - self.below_min_since > el.wait_s:
            state.stop_reason = (f"only {len(state.members)} worker(s) left, fewer than launcher.min_workers="
                                 f"{lc.min_workers}, for elastic.wait_s={el.wait_s:g}s")
            self._below_min_ended(now, "stopped")
            state.event("stop", reason=state.stop_reason, generation=state.generation + 1)
            self.publish("stop", state.stop_reason)

    def _below_min_ended(self, now: float, outcome: str) -> None:
        """The wait below launcher.min_workers is over (the goodput ledger's ``below_min``)."""
        state = self.state
        state.event("below_min", waited_s=round(now - self.below_min_since, 4), outcome=outcome,
                    min_workers=state.cfg.launcher.min_workers, workers=len(state.members) + len(state.admitted))
        self.below_min_since = None
