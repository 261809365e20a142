"""The agent's side of joining: signed join requests, read as they are written, judged and answered.

A worker counts itself (``join/count``), writes ``join/request/<n>`` and waits for ``join/verdict/<n>``
(membership.Membership.join). Admitted workers enter the next generation (generations.Generations.publish).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Dict

from .. import protocol
from . import workers_json
from .hosts import Hosts
from .process import Worker
from .state import AgentState
from ..._util.untrusted import printable

log = logging.getLogger("elasticflow")


REFUSAL_EVENTS = 20   # refused joins written to events.jsonl one by one; past this, only counted (a flood)
RECHECK_S = 10.0      # how long a request that failed its MAC is re-read: a real worker may overwrite a forgery
RECHECKS_KEPT = 32    # ... and how many at most (the newest)


class Admission:
    """The join requests of one job, answered from ``state`` (``hosts``: the node agents, whose workers join with
    the ids they drew). Owns the join inbox and what it remembers of refused requests."""

    def __init__(self, state: AgentState, hosts: Hosts):
        self.state, self.hosts = state, hosts
        # Every worker of a starting job asks at once: the backlog holds them all (at 1,024 workers, 256 dropped
        # the older requests of each burst, whose workers asked again 5 s later, and some gave up)
        lc = state.cfg.launcher
        expected = max(lc.workers * (lc.nodes or 1), lc.max_workers or 0)
        self.requests = protocol.Inbox("join/count", "join/request", backlog=max(256, 2 * expected))
        self.refused = 0
        self.rechecks: Dict[int, tuple] = {}  # requests that failed their MAC, read again

    def admit(self) -> None:
        """Answer every join request written since the last round (the agent's loop, every REQUESTS_S)."""
        state = self.state
        admitted = False
        for n, request in list(self.requests.read(state.store)) + self._changed():
            try:
                verdict = self.judge(n, request)
            except Exception as exc:  # noqa: BLE001 - a request is anyone's to write: never fatal to the agent
                verdict = {"ok": False,
                           "reason": f"wrong or missing job token (a malformed request: {type(exc).__name__})"}
            unsigned = not verdict["ok"] and "token" in verdict["reason"]  # failed its MAC, or no request at all
            if not verdict["ok"]:
                self.refused += 1
                if unsigned:
                    self.rechecks[n] = (request, time.monotonic())
                    while len(self.rechecks) > RECHECKS_KEPT:  # a flood: each is a store read per round
                        del self.rechecks[min(self.rechecks)]
                if self.refused <= REFUSAL_EVENTS:
                    log.warning("refused a join request from pid %s on %s: %s", _shown(request.get("pid")),
                                _shown(request.get("host")), verdict["reason"])
                    state.event("refused", pid=_shown(request.get("pid")), host=_shown(request.get("host")),
                                reason=verdict["reason"])
                else:
                    protocol.REFUSED("join request", verdict["reason"])
                if unsigned:
                    # Never answered: a sealed refusal of a request anyone may write (copying a real joiner's
                    # nonce) would stop that joiner. A worker learns its token is wrong from job/check instead.
                    continue
            nonce = request.get("nonce")
            verdict["nonce"] = nonce if isinstance(nonce, str) else None  # whose request this answers
            protocol.put(state.store, state.verdicts, protocol.verdict_key(n), json.dumps(verdict))
            admitted = admitted or verdict["ok"]
        if admitted:  # once a round, not per admission: workers.json lists every worker (1,024 joins were N^2)
            workers_json.write(state)  # `status` and `scale` see them admitted (they enter the next generation)

    def _changed(self) -> list:
        """Requests that failed their MAC, read again: a worker that counted ``n`` after a stranger wrote
        ``join/request/<n>`` overwrites the forgery with its own, which deserves a verdict of its own."""
        out, now = [], time.monotonic()
        for n, (seen, since) in list(self.rechecks.items()):
            if now - since > RECHECK_S:
                del self.rechecks[n]
                continue
            key = f"join/request/{n}"
            # never get(): a key a stranger deleted would wait for the timeout
            raw = protocol.read(self.state.store, key)
            try:
                request = seen if raw is None else protocol.loads(raw)
            except ValueError:
                continue
            if isinstance(request, dict) and request != seen:
                del self.rechecks[n]
                out.append((n, request))
        return out

    def judge(self, n: int, request: dict) -> dict:
        """Admit the worker of request ``n`` (an agent's, a node agent's, or one started by hand with the
        token), or say why not."""
        state = self.state
        wid, pid, node, host, nonce = (request.get(k) for k in ("id", "pid", "node", "host", "nonce"))
        if not (type(wid) is int and type(pid) is int and pid > 0 and isinstance(host, str)
                and isinstance(nonce, str) and (node is None or isinstance(node, str))):
            return {"ok": False, "reason": "wrong or missing job token (a malformed request)"}
        if not protocol.verify(state.token, protocol.join_message(n, wid, pid, node, host, nonce), request.get("mac")):
            return {"ok": False, "reason": "wrong or missing job token"}
        # The same process asking again (its verdict was late: a stalled store): the same id, never a second one.
        # By id too: a load script's members share a process; -1 is a worker started by hand, which has no id yet.
        again = next((w for w in state.admitted if w.pid == pid and w.host == host and wid in (w.id, -1)), None)
        if again is not None:
            return {"ok": True, "id": again.id, "job": state.job}
        cap = state.cfg.launcher.max_workers
        if cap and len(state.members) + len(state.admitted) >= cap:
            return {"ok": False, "reason": f"the job already has launcher.max_workers={cap} workers"}
        worker = state.joining.get(wid)
        if worker is not None:
            worker.pid = pid  # behind srun, the process we started is srun, not the worker
        elif node is not None and self.hosts.knows(node, wid):
            worker = self.hosts.worker(node, wid, pid)  # a node agent's, with the id it drew from the store
        else:
            # Started by someone holding the token (another launcher): give it a fresh id.
            worker = Worker(state.new_id(), pid, None, host)
        worker.host = host
        if state.roster.place_of(worker) is None:
            state.roster.add(worker, "admitted")
        else:
            state.roster.move(worker, "admitted")
        return {"ok": True, "id": worker.id, "job": state.job}


def _shown(value) -> str:
    return printable(value, limit=64)  # a stranger's "host" reaches the console and status: never as escapes
