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
from typing import TYPE_CHECKING

from . import protocol
from .process import Worker
from .rendezvous import key

if TYPE_CHECKING:  # the agent's parts take it typed; importing it at run time would be a cycle
    from .agent import Agent

log = logging.getLogger("elasticflow")
ENDED = (protocol.EXIT_OK, protocol.EXIT_INTERRUPTED, protocol.EXIT_BELOW_MIN)  # a member's exit that ends the job
REPORT_GRACE_S = 2.0  # after a peer reports a failed collective, how long the others have to report too
FULL_ROUND = 64       # up to this many workers, every heartbeat is read every round (HEALTH_S)
HEALTH_S = 0.1        # the agent's round (agent.HEALTH_S: not imported, agent.py imports this module)


def check(agent: "Agent", now: float) -> None:
    el = agent.cfg.elastic
    ended = any(w.poll() in ENDED for w in agent.finished)  # the others stop heartbeating as they close
    # Retiring workers too: until a retiring worker leaves at the step boundary it is still in the current
    # group, and its peers' allreduce waits for it; stopped, it would hold them for elastic.timeout_s.
    for w in due(agent, [*agent.members, *agent.waiting, *agent.retiring], el.heartbeat_timeout_s):
        if w.state == "killed":
            continue
        beat = protocol.fetch(agent.store, agent.sealer, f"worker/{w.id}/hb", "heartbeat")
        if beat is not None and int(beat) > w.hb_value:  # a sequence: a replayed (older) beat is no beat
            w.hb_value, w.hb_seen = int(beat), now
        elif now - w.hb_seen > el.heartbeat_timeout_s and not ended:
            cut_out(agent, w, f"no heartbeat for {now - w.hb_seen:.1f}s (stopped or hung)")
        elif now - w.hb_seen > el.heartbeat_timeout_s and w.proc is None and w.node is not None:
            # After the end, a worker of another host whose exit was never reported (its host went down
            # as the job ended) is not waited for: it has nothing left to do.
            agent.roster.move(w, "finished")
    if ended:
        return
    g = agent.generation
    if g < 0 or not agent.members:
        return
    reassert(agent)
    if agent.supersede_at is None:
        # A waiting worker that arrived at the newest generation is ready: it enters the next one. (Not
        # while a successor is due: it arrived at the failed generation, before it was left out.)
        agent.roster.move_all([w for w in agent.waiting if has_reported(agent, g, "arrived", w.id)], "admitted")
    if not agent.dirty:  # when dirty, the next generation is published this round anyway
        verdict = agent.rdv.poll(now, [w.id for w in agent.members if w.state != "killed"])
        if verdict is not None:
            judged(agent, verdict, now)
    if agent.rdv.phase != "formed":
        return
    failed = agent.rdv.reports(now, [w.id for w in agent.members])
    reported = [w for w in agent.members if w.id in failed]
    if not reported or len(reported) == len(agent.members):
        agent.failed_reports_since.pop(g, None)
        return
    since = agent.failed_reports_since.setdefault(g, now)
    for w in [w for w in agent.members if w not in reported and w.node is not None and agent.hosts.silent(w.node, now)]:
        cut_out(agent, w, f"its peers' collectives failed and its host {w.node} went silent (down or cut off)")
    if now - since > min(REPORT_GRACE_S, el.heartbeat_timeout_s):
        for w in list(agent.members):  # _cut_out removes a worker of another host from the list
            if w not in reported and w.state != "killed":
                cut_out(agent, w, "its peers' collectives failed and it never reported (stuck or deadlocked)")

def due(agent: "Agent", workers: list, heartbeat_timeout_s: float) -> list:
    """The workers whose heartbeat this round reads: all of them in a job of up to FULL_ROUND, else a turn of the
    list such that each is read at least every min(1 s, heartbeat_timeout_s / 4) (a cut-out comes that much later
    at most): every member's every round was N reads a round, 10k a second at 1,024 members."""
    n = len(workers)
    if n <= FULL_ROUND:
        return workers
    take = min(n, math.ceil(n * HEALTH_S / min(1.0, heartbeat_timeout_s / 4)))
    start = agent.hb_cursor % n
    agent.hb_cursor = start + take
    return (workers + workers)[start:start + take]


def has_reported(agent: "Agent", g: int, what: str, worker_id: int) -> bool:
    return protocol.fetch(agent.store, agent.sealer, key(g, what, worker_id), "arrival") is not None

def judged(agent: "Agent", v, now: float) -> None:
    """The forming generation formed, or failed: then its successor is due (after the back-off)."""
    if v.outcome == "formed":
        for w in agent.members:
            w.has_state = True
        arrived = agent.rdv.arrived_at  # where formation time goes: every member's arrival, then gloo's build
        agent.event("formed", generation=v.generation, world=len(agent.rdv.ids), formed_s=round(v.after_s, 3),
                    arrived_s=None if arrived is None else round(arrived - agent.rdv.published_at, 3))
        return
    keep = [w for w in agent.members if w.id in v.keep and w.state != "killed"]
    alive = [w for w in agent.members if w.state != "killed"]
    if len(keep) < max(1, agent.cfg.launcher.min_workers) or not any(w.has_state for w in keep):
        # Too few to go on without the rest, or only joiners, who hold no training state: retry with
        # every live member (after the back-off).
        keep = alive
    left_out = [w for w in alive if w not in keep]
    agent.roster.move_all(left_out, "waiting")
    delay = agent.rdv.backoff_s()
    log.warning("generation %d did not form (%s); the next one in %.2fs with %d worker(s)",
                v.generation, v.cause, delay, len(keep))
    agent.event("superseded", generation=v.generation, cause=v.cause, after_s=round(v.after_s, 3),
               waiting=[w.id for w in left_out], retry_in_s=delay, failures=agent.rdv.failures)
    agent.supersede_at, agent.supersede_cause = now + delay, v.cause

def cut_out(agent: "Agent", w: Worker, why: str) -> None:
    log.warning("worker %d (pid %d): %s; killing it", w.id, w.pid, why)
    agent.event("hung", worker=w.id, pid=w.pid, reason=why, generation=agent.generation)
    agent._put(protocol.cut_key(w.id), why)  # a cut-off worker that outlives the kill reads why
    agent.roster.cut(w)
    w.signal(signal.SIGKILL)
    if w.proc is None:  # not our child: we cannot wait for its exit code
        place = agent.roster.place_of(w)
        agent.roster.drop(w)
        if place == "retiring":
            agent.event("retired", worker=w.id, pid=w.pid, exit_code=-int(signal.SIGKILL))
            return
        member = place == "members"
        agent._lost(w, "killed: hung", dirty=member)  # a waiting worker is in no group: nothing to publish


def reassert(agent: "Agent") -> None:
    """Put back records a stranger replaced: the newest generation's (workers refuse the forgery, and would
    wait for the real record), and the checkpoint folder the workers agreed on (a joiner reads it; the agent
    pins the first value that verifies). Four round trips per health round."""
    # The workers agree on the folder before they join (checkpoint.save.Checkpointer.for_run): with the token's
    # sealer, not the job's, which they learn from the join verdict.
    for what in ("ckpt/job", "ckpt/token"):
        slot = f"{what}/{agent.verdicts.name(what)}"
        raw = protocol.read(agent.store, slot) if slot not in agent.record else None
        if protocol.opened(agent.verdicts, slot, raw, "checkpoint job"):  # the value read, not a second read
            agent.record[slot] = raw.decode(errors="replace")
    for name in ("gen/current", protocol.generation_key(agent.generation), "job/check",
                 *[k for k in agent.record if k.startswith("ckpt/")]):
        sealed = agent.record.get(name)
        if sealed is not None and (protocol.read(agent.store, name) or b"").decode(errors="replace") != sealed:
            kind = "gen/current" if name == "gen/current" else "generation" if name.startswith("gen/") else \
                "job check" if name == "job/check" else "checkpoint job"
            protocol.REFUSED(kind, f"{name} was replaced; put back")
            agent.store.set(name, sealed)
