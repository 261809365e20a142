"""The agent's health round (every HEALTH_S): heartbeats, arrivals and failure reports, the verdict on a
forming generation, and cutting out members that went silent.

Health: a member whose heartbeat stops for ``elastic.heartbeat_timeout_s`` (a stopped process) is
SIGKILLed; so is one that never reports when its peers' collectives of a generation failed (a
deadlock or a stuck collective). Killing, not aborting, is what wakes peers blocked on it.
Every record read here is sealed (_util/sealing.py): a stranger's is refused, never acted on.
"""
from __future__ import annotations

import logging
import math
import signal
from typing import Callable, Dict, List, Tuple

from .. import protocol
from ..membership.rendezvous import Rendezvous, key
from .hosts import Hosts
from .process import Worker
from .state import AgentState

log = logging.getLogger("elasticflow")
ENDED = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN)  # a member's exit that ends the job
REPORT_GRACE_S = 2.0  # after a peer reports a failed collective, how long the others have to report too
FULL_ROUND = 64       # up to this many workers, every heartbeat is read every round (HEALTH_S)
HEALTH_S = 0.1        # the agent's round (agent.HEALTH_S: not imported, agent.py imports this module)


class Health:
    """The health round of the job in ``state``: ``rdv`` is the forming generation's rendezvous, ``hosts`` the
    node agents (a silent host's workers are cut out at once), ``lost(worker, cause, dirty)`` what the agent does
    with a worker it killed that is not its child (processes.Processes.lost). Owns the heartbeat cursor and when
    each generation's first failure report came."""

    def __init__(self, state: AgentState, rdv: Rendezvous, hosts: Hosts, lost: Callable[..., None]):
        self.state, self.rdv, self.hosts, self.lost = state, rdv, hosts, lost
        self.failed_reports_since: Dict[int, float] = {}
        self.hb_cursor = 0                    # where the next round's heartbeat reads start (``due``)

    def check(self, now: float) -> None:
        state, rdv, el = self.state, self.rdv, self.state.cfg.elastic
        ended = any(w.poll() in ENDED for w in state.finished)  # the others stop heartbeating as they close
        # Retiring workers too: until a retiring worker leaves at the step boundary it is still in the current
        # group, and its peers' allreduce waits for it; stopped, it would hold them for elastic.timeout_s.
        workers, self.hb_cursor = due([*state.members, *state.waiting, *state.retiring], el.heartbeat_timeout_s,
                                      self.hb_cursor)
        for w in workers:
            if w.state == "killed":
                continue
            beat = protocol.fetch(state.store, state.sealer, f"worker/{w.id}/hb", "heartbeat")
            if beat is not None and int(beat) > w.hb_value:  # a sequence: a replayed (older) beat is no beat
                w.hb_value, w.hb_seen = int(beat), now
            elif now - w.hb_seen > el.heartbeat_timeout_s and not ended:
                self.cut_out(w, f"no heartbeat for {now - w.hb_seen:.1f}s (stopped or hung)")
            elif now - w.hb_seen > el.heartbeat_timeout_s and w.proc is None and w.node is not None:
                # After the end, a worker of another host whose exit was never reported (its host went down
                # as the job ended) is not waited for: it has nothing left to do.
                state.roster.move(w, "finished")
        if ended:
            return
        g = state.generation
        if g < 0 or not state.members:
            return
        self.reassert()
        if state.supersede_at is None:
            # A waiting worker that arrived at the newest generation is ready: it enters the next one. (Not
            # while a successor is due: it arrived at the failed generation, before it was left out.)
            state.roster.move_all([w for w in state.waiting if self.has_reported(g, "arrived", w.id)], "admitted")
        if not state.dirty:  # when dirty, the next generation is published this round anyway
            verdict = rdv.poll(now, [w.id for w in state.members if w.state != "killed"])
            if verdict is not None:
                self.judged(verdict, now)
        if rdv.phase != "formed":
            return
        failed = rdv.reports(now, [w.id for w in state.members])
        reported = [w for w in state.members if w.id in failed]
        if not reported or len(reported) == len(state.members):
            self.failed_reports_since.pop(g, None)
            return
        since = self.failed_reports_since.setdefault(g, now)
        for w in [w for w in state.members
                  if w not in reported and w.node is not None and self.hosts.silent(w.node, now)]:
            self.cut_out(w, f"its peers' collectives failed and its host {w.node} went silent (down or cut off)")
        if now - since > min(REPORT_GRACE_S, el.heartbeat_timeout_s):
            for w in list(state.members):  # cut_out removes a worker of another host from the list
                if w not in reported and w.state != "killed":
                    self.cut_out(w, "its peers' collectives failed and it never reported (stuck or deadlocked)")

    def has_reported(self, g: int, what: str, worker_id: int) -> bool:
        return protocol.fetch(self.state.store, self.state.sealer, key(g, what, worker_id), "arrival") is not None

    def judged(self, v, now: float) -> None:
        """The forming generation formed, or failed: then its successor is due (after the back-off)."""
        state, rdv = self.state, self.rdv
        if v.outcome == "formed":
            for w in state.members:
                w.has_state = True
            arrived = rdv.arrived_at  # where formation time goes: every member's arrival, then gloo's build
            state.event("formed", generation=v.generation, world=len(rdv.ids), formed_s=round(v.after_s, 3),
                        arrived_s=None if arrived is None else round(arrived - rdv.published_at, 3))
            return
        keep = [w for w in state.members if w.id in v.keep and w.state != "killed"]
        alive = [w for w in state.members if w.state != "killed"]
        if len(keep) < max(1, state.cfg.launcher.min_workers) or not any(w.has_state for w in keep):
            # Too few to go on without the rest, or only joiners, who hold no training state: retry with
            # every live member (after the back-off).
            keep = alive
        left_out = [w for w in alive if w not in keep]
        state.roster.move_all(left_out, "waiting")
        delay = rdv.backoff_s()
        log.warning("generation %d did not form (%s); the next one in %.2fs with %d worker(s)",
                    v.generation, v.cause, delay, len(keep))
        state.event("superseded", generation=v.generation, cause=v.cause, after_s=round(v.after_s, 3),
                    waiting=[w.id for w in left_out], retry_in_s=delay, failures=rdv.failures)
        state.supersede_at, state.supersede_cause = now + delay, v.cause

    def cut_out(self, w: Worker, why: str) -> None:
        state = self.state
        log.warning("worker %d (pid %d): %s; killing it", w.id, w.pid, why)
        state.causes[w.id] = f"hung: {why}"  # the next generation's record says so (reporting.membership_line)
        state.event("hung", worker=w.id, pid=w.pid, reason=why, generation=state.generation)
        state.put(protocol.cut_key(w.id), why)  # a cut-off worker that outlives the kill reads why
        state.roster.cut(w)
        w.signal(signal.SIGKILL)
        if w.proc is None:  # not our child: we cannot wait for its exit code
            place = state.roster.place_of(w)
            state.roster.drop(w)
            if place == "retiring":
                state.event("retired", worker=w.id, pid=w.pid, exit_code=-int(signal.SIGKILL))
                return
            member = place == "members"
            self.lost(w, "killed: hung", dirty=member)  # a waiting worker is in no group: nothing to publish

    def reassert(self) -> None:
        """Put back records a stranger replaced: the newest generation's (workers refuse the forgery, and would
        wait for the real record), and the checkpoint folder the workers agreed on (a joiner reads it; the agent
        pins the first value that verifies). Four round trips per health round."""
        state = self.state
        # The workers agree on the folder before they join (checkpoint.save.Checkpointer.for_run): with the
        # token's sealer, not the job's, which they learn from the join verdict.
        for what in ("ckpt/job", "ckpt/token"):
            slot = f"{what}/{state.verdicts.name(what)}"
            raw = protocol.read(state.store, slot) if slot not in state.record else None
            if protocol.opened(state.verdicts, slot, raw, "checkpoint job"):  # the value read, not a second read
                state.record[slot] = raw.decode(errors="replace")
        for name in ("gen/current", protocol.generation_key(state.generation), "job/check",
                     *[k for k in state.record if k.startswith("ckpt/")]):
            sealed = state.record.get(name)
            if sealed is not None and (protocol.read(state.store, name) or b"").decode(errors="replace") != sealed:
                kind = "gen/current" if name == "gen/current" else "generation" if name.startswith("gen/") else \
                    "job check" if name == "job/check" else "checkpoint job"
                protocol.REFUSED(kind, f"{name} was replaced; put back")
                state.store.set(name, sealed)


def due(workers: List[Worker], heartbeat_timeout_s: float, cursor: int) -> Tuple[List[Worker], int]:
    """The workers whose heartbeat this round reads, and the cursor for the next round: all of them in a job of up
    to FULL_ROUND, else a turn of the list from ``cursor`` such that each is read at least every
    min(1 s, heartbeat_timeout_s / 4) (a cut-out comes that much later at most): every member's every round was N
    reads a round, 10k a second at 1,024 members."""
    n = len(workers)
    if n <= FULL_ROUND:
        return workers, cursor
    take = min(n, math.ceil(n * HEALTH_S / min(1.0, heartbeat_timeout_s / 4)))
    start = cursor % n
    return (workers + workers)[start:start + take], start + take
