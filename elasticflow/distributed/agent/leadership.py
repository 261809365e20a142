"""Which process is the job's agent when its records live in etcd (``launcher.store=etcd``), and what a standby
needs to take over: the agent's leadership is a key held by an etcd lease, and its state a sealed record.

    agent/leader   "<host>:<pid>:<nonce>@<lease>" sealed with the token, bound to that lease: gone within
                   ``launcher.etcd.lease_s`` of the leader's last renewal (its host powered off, cut off, or the
                   process stopped). One that does not verify, or is not held by the lease it names (put by
                   another of the CA's certificates, or a leader's record copied back with no lease: either
                   would stand for ever), is no leader: refused, logged once, and claimed over
    agent/state    the agent's state, sealed with the token (it names the job id): the generation and its
                   members with their hosts, the places of every other worker, the node agents, how far each
                   inbox was read; rewritten whenever it changes, and every lease period (``at``)

Every host runs a standby (launchers/failover.py). The first to claim the key starts the job; when the leader's
lease expires, the first standby to claim it rebuilds the agent from ``agent/state`` (``restore``) and goes on:
the workers never left their generation, and those of the lost host are cut out by the new agent's health round
as any silent member is. The agent's client of the store is fenced on the key (store/etcd.py), so an agent whose
lease expired cannot write after its successor took over. A forged key deposes the agent too (its fenced writes
fail), but every standby, its own included, sees no leader in it: the first to claim over it goes on from
``agent/state`` at once, as after a lost leader.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import time
from typing import Any, Callable, Optional, Tuple

from .. import protocol
from ..membership.rendezvous import Rendezvous
from ..store.etcd import Deposed, EtcdError, EtcdStore
from .admission import Admission
from .hosts import Hosts
from .inject import Injection
from .process import Worker
from .scaling import Scaling
from .state import AgentState

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
        self.record = ""  # the leader key's value while we lead: "<name>@<lease>", sealed (the fence compares it)
        self.renew_at = 0.0
        self.written, self.written_at = "", 0.0
        self.forged = False  # the last claim replaced a leader key that was no leader's (not a lease that expired)

    def holder(self) -> Optional[str]:
        """The leader's name; None when there is none, or the key is no leader's (refused, logged once)."""
        return self._holder(self.store.entry(LEADER))

    def _holder(self, entry: Optional[Tuple[bytes, str]]) -> Optional[str]:
        """A leader's record verifies with the token and is held by the lease it names: a record of ours copied
        back with no lease (or another's) is a replay that would stand for ever, as a forged one would."""
        if entry is None:
            return None
        raw, lease = entry
        payload = protocol.opened(self.sealer, LEADER, raw, "agent leader")
        if payload is None:
            return None
        name, _, named = payload.rpartition("@")
        if named != lease:
            protocol.REFUSED("agent leader", f"a leader record held by lease {lease}, not by {named}, the one it names")
            return None
        return name

    def claim(self) -> bool:
        """Try to become the leader (a fresh lease each try: an expired one cannot be renewed). A key that is no
        leader's is replaced, compared by value: of two standbys that both saw it, only the first wins."""
        entry = self.store.entry(LEADER)
        if self._holder(entry) is not None:
            return False
        if self.lease is not None:  # ours until we were deposed: it holds nothing now, and may have expired
            try:
                self._revoke()
            except EtcdError:
                pass  # expired: etcd no longer knows it
        self.lease = self.store.grant(max(2, round(self.lease_s)))
        self.record = self.sealer.seal(LEADER, f"{self.name}@{self.lease}")
        if self.store.claim(LEADER, self.record, self.lease, replacing=None if entry is None else entry[0]):
            self.renew_at = time.monotonic() + self.lease_s / 3
            self.forged = entry is not None
            return True
        self._revoke()
        return False

    def _revoke(self) -> None:
        lease, self.lease = self.lease, None
        self.store.revoke(lease)

    def fenced(self) -> EtcdStore:
        """A client whose every write needs this process to hold the leader key (for the agent)."""
        return EtcdStore(self.store.addr, datetime.timedelta(seconds=self.store.timeout_s),
                         fence=(LEADER, self.record))

    def state(self) -> Optional[dict]:
        """The newest agent's state; None when absent, forged, ended, or not refreshed for ``stale_s``."""
        state = protocol.fetch_json(self.store, self.sealer, STATE, "agent state")
        if state is None or state.get("ended") or not isinstance(state.get("at"), (int, float)):
            return None
        return state if time.time() - state["at"] < stale_s(self.lease_s) else None

    def tick(self, store: Any, snapshot: Callable[[], dict]) -> None:
        """The leader's round (the agent's loop): renew the lease, and write the agent's state (``snapshot()``,
        through the agent's fenced ``store``) when it changed."""
        now = time.monotonic()
        if now >= self.renew_at:
            if self.store.keepalive(self.lease) <= 0:
                raise Deposed("the agent's lease expired before it was renewed (the agent's process stalled)")
            self.renew_at = now + self.lease_s / 3
        self.write(store, snapshot(), now)

    def write(self, store: Any, current: dict, now: float, ended: bool = False) -> None:
        state = json.dumps(current, sort_keys=True)
        if state != self.written or now - self.written_at > self.lease_s / 3 or ended:
            record = {**current, "at": time.time(), "ended": ended}
            store.set(STATE, self.sealer.seal(STATE, json.dumps(record)))
            self.written, self.written_at = state, now

    def resign(self, store: Any = None, current: Optional[dict] = None) -> None:
        """The job is over: say so in the state (no standby takes over a finished job), and free the key.
        ``store``, ``current``: the agent's store and its last state (``Agent.state_dict``); None after a crash."""
        if current is not None:
            self.write(store, current, time.monotonic(), ended=True)
        if self.lease is not None:
            self._revoke()


def snapshot(state: AgentState, rdv: Rendezvous, hosts: Hosts, admission: Admission, scaling: Scaling,
             injection: Injection) -> dict:
    """What a standby needs to go on where the agent of these parts is: JSON only."""
    return {"job": state.job, "generation": state.generation, "trained": state.trained, "restarts": state.restarts,
            "formed": rdv.phase == "formed",
            "places": {p: [_worker(w) for w in getattr(state.roster, p)] for p in PLACES},
            "nodes": hosts.nodes, "scale_nonces": list(scaling.nonces), "inject_nonces": list(injection.nonces),
            "inboxes": {name: [box.seen, sorted(box.unread)]
                        for name, box in _inboxes(hosts, admission, scaling, injection).items()}}


def restore(saved: dict, state: AgentState, rdv: Rendezvous, hosts: Hosts, admission: Admission,
            scaling: Scaling, injection: Injection) -> None:
    """Put the parts of an agent (new, in a standby's process) where the ``saved`` state's agent was. Its members'
    heartbeats are timed from now: those that stopped with the lost host are cut out after
    ``elastic.heartbeat_timeout_s``."""
    now = time.monotonic()
    state.generation, state.trained, state.restarts = saved["generation"], saved["trained"], saved["restarts"]
    for place in PLACES:
        for fields in saved["places"][place]:
            w = state.roster.add(Worker(fields["id"], fields["pid"], None, host=fields["host"], node=fields["node"],
                                        outbox=hosts.outbox, slot=fields["slot"],
                                        has_state=fields["has_state"], exit_code=fields["code"]), place)
            w.hb_seen = now
    state.published = list(state.members)
    hosts.nodes = dict(saved["nodes"])
    hosts.beats = {name: (-1, now) for name in hosts.nodes}
    scaling.nonces = dict.fromkeys(saved["scale_nonces"])
    # The inject requests already acted on stay so: a kill asked a minute before the handover, read again from
    # the inbox's start, would have killed a second member (its nonce unknown here, still fresh).
    injection.nonces = dict.fromkeys(saved.get("inject_nonces", []))
    for name, box in _inboxes(hosts, admission, scaling, injection).items():
        if name in saved["inboxes"]:  # (an agent of an older tree handed no inject inbox over)
            box.seen, unread = saved["inboxes"][name]
            box.unread = dict.fromkeys(unread, now)
    if state.generation >= 0:
        rdv.opened(state.generation, [w.id for w in state.members], now)
        if saved["formed"]:
            rdv.phase = "formed"
    for key in ("gen/current", protocol.generation_key(state.generation), "job/check"):
        raw = protocol.read(state.store, key)  # the records Health.reassert keeps: as the last agent sealed them
        if raw is not None:
            state.record[key] = raw.decode(errors="replace")


def _worker(w: Worker) -> dict:
    return {"id": w.id, "pid": w.pid, "host": w.host, "node": w.node, "slot": w.slot, "has_state": w.has_state,
            "code": w.poll()}


def _inboxes(hosts: Hosts, admission: Admission, scaling: Scaling, injection: Injection) -> dict:
    return {"join": admission.requests, "scale": scaling.requests, "nodes": hosts.requests, "exits": hosts.exits,
            "inject": injection.requests}
