"""Which process is the job's agent when its records live in etcd (``launcher.store=etcd``), and what a standby
needs to take over: the agent's leadership is a key held by an etcd lease, and its state a sealed record.

    agent/leader   "<host>:<pid>:<nonce>", bound to the leader's lease: gone within ``launcher.etcd.lease_s`` of
                   the leader's last renewal (its host powered off, cut off, or the process stopped)
    agent/state    the agent's state, sealed with the token (it names the job id): the generation and its
                   members with their hosts, the places of every other worker, the node agents, how far each
                   inbox was read; rewritten whenever it changes, and every lease period (``at``)

Every host runs a standby (launchers/failover.py). The first to claim the key starts the job; when the leader's
lease expires, the first standby to claim it rebuilds the agent from ``agent/state`` (``restore``) and goes on:
the workers never left their generation, and those of the lost host are cut out by the new agent's health round
as any silent member is. The agent's client of the store is fenced on the key (etcd_store.py), so an agent whose
lease expired cannot write after its successor took over.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Optional

from . import protocol
from .etcd_store import Deposed, EtcdStore
from .process import Worker

if TYPE_CHECKING:  # the agent's parts take it typed; importing it at run time would be a cycle
    from .agent import Agent

LEADER, STATE = "agent/leader", "agent/state"
PLACES = ("admitted", "members", "waiting", "retiring", "finished")


def stale_s(lease_s: float) -> float:
    """A state record not refreshed for this long is a job that ended without saying so (every host lost)."""
    return max(30.0, 10 * lease_s)


class Leadership:
    """This process's claim on ``agent/leader`` over ``store`` (an unfenced client of its own)."""

    def __init__(self, store: EtcdStore, token: str, lease_s: float):
        self.store, self.lease_s = store, lease_s
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.sealer = protocol.Sealer(token)  # the state names the job id: sealed with the token alone
        self.lease: Optional[str] = None
        self.renew_at = 0.0
        self.written, self.written_at = "", 0.0

    def holder(self) -> Optional[str]:
        return self.store.holder(LEADER)

    def claim(self) -> bool:
        """Try to become the leader (a fresh lease each try: an expired one cannot be renewed)."""
        self.lease = self.store.grant(max(2, round(self.lease_s)))
        if self.store.claim(LEADER, self.name, self.lease):
            self.renew_at = time.monotonic() + self.lease_s / 3
            return True
        self.store.revoke(self.lease)
        self.lease = None
        return False

    def fenced(self) -> EtcdStore:
        """A client whose every write needs this process to hold the leader key (for the agent)."""
        return EtcdStore(self.store.addr, datetime.timedelta(seconds=self.store.timeout_s), fence=(LEADER, self.name))

    def state(self) -> Optional[dict]:
        """The newest agent's state; None when absent, forged, ended, or not refreshed for ``stale_s``."""
        state = protocol.fetch_json(self.store, self.sealer, STATE, "agent state")
        if state is None or state.get("ended") or not isinstance(state.get("at"), (int, float)):
            return None
        return state if time.time() - state["at"] < stale_s(self.lease_s) else None

    def tick(self, agent: "Agent") -> None:
        """The leader's round (the agent's loop): renew the lease, and write the state when it changed."""
        now = time.monotonic()
        if now >= self.renew_at:
            if self.store.keepalive(self.lease) <= 0:
                raise Deposed("the agent's lease expired before it was renewed (the agent's process stalled)")
            self.renew_at = now + self.lease_s / 3
        self.write(agent, now)

    def write(self, agent: "Agent", now: float, ended: bool = False) -> None:
        current = snapshot(agent)
        state = json.dumps(current, sort_keys=True)
        if state != self.written or now - self.written_at > self.lease_s / 3 or ended:
            record = {**current, "at": time.time(), "ended": ended}
            agent.store.set(STATE, self.sealer.seal(STATE, json.dumps(record)))
            self.written, self.written_at = state, now

    def resign(self, agent: Optional["Agent"]) -> None:
        """The job is over: say so in the state (no standby takes over a finished job), and free the key."""
        if agent is not None:
            self.write(agent, time.monotonic(), ended=True)
        if self.lease is not None:
            self.store.revoke(self.lease)
            self.lease = None


def snapshot(agent: "Agent") -> dict:
    """What a standby needs to go on where ``agent`` is: JSON only."""
    return {"job": agent.job, "generation": agent.generation, "trained": agent.trained, "restarts": agent.restarts,
            "formed": agent.rdv.phase == "formed",
            "places": {p: [_worker(w) for w in getattr(agent.roster, p)] for p in PLACES},
            "nodes": agent.hosts.nodes, "scale_nonces": list(agent.scale_nonces),
            "inboxes": {name: [box.seen, sorted(box.unread)] for name, box in _inboxes(agent).items()}}


def restore(agent: "Agent", state: dict) -> None:
    """Put ``agent`` (new, in a standby's process) where the state's agent was. Its members' heartbeats are timed
    from now: those that stopped with the lost host are cut out after ``elastic.heartbeat_timeout_s``."""
    now = time.monotonic()
    agent.generation, agent.trained, agent.restarts = state["generation"], state["trained"], state["restarts"]
    for place in PLACES:
        for fields in state["places"][place]:
            w = agent.roster.add(Worker(fields["id"], fields["pid"], None, host=fields["host"], node=fields["node"],
                                        outbox=agent.hosts.outbox, slot=fields["slot"],
                                        has_state=fields["has_state"], exit_code=fields["code"]), place)
            w.hb_seen = now
    agent.published = list(agent.members)
    agent.hosts.nodes = dict(state["nodes"])
    agent.hosts.beats = {name: (-1, now) for name in agent.hosts.nodes}
    agent.scale_nonces = dict.fromkeys(state["scale_nonces"])
    for name, box in _inboxes(agent).items():
        box.seen, unread = state["inboxes"][name]
        box.unread = dict.fromkeys(unread, now)
    if agent.generation >= 0:
        agent.rdv.opened(agent.generation, [w.id for w in agent.members], now)
        if state["formed"]:
            agent.rdv.phase = "formed"
    for key in ("gen/current", protocol.generation_key(agent.generation), "job/check"):
        raw = protocol.read(agent.store, key)  # the records reassert() keeps: as the last agent sealed them
        if raw is not None:
            agent.record[key] = raw.decode(errors="replace")


def _worker(w: Worker) -> dict:
    return {"id": w.id, "pid": w.pid, "host": w.host, "node": w.node, "slot": w.slot, "has_state": w.has_state,
            "code": w.poll()}


def _inboxes(agent: "Agent") -> dict:
    return {"join": agent.join_requests, "scale": agent.scale_requests, "nodes": agent.hosts.requests,
            "exits": agent.hosts.exits}
