"""The agent's side of joining: signed join requests, read as they are written, judged and answered.

A worker counts itself (``join/count``), writes ``join/request/<n>`` and waits for ``join/verdict/<n>``
(membership.Membership.join). Admitted workers enter the next generation (agent.publish).
"""
from __future__ import annotations

import json
import logging

from . import protocol
from .process import Worker

log = logging.getLogger("elasticflow")


def admit(agent) -> None:
    """Answer every join request written since the last round (the agent's loop, every REQUESTS_S)."""
    for n, request in agent.join_requests.read(agent.store):
        try:
            verdict = judge(agent, n, request)
        except (ValueError, KeyError, TypeError) as exc:
            verdict = {"ok": False, "reason": f"malformed join request ({exc})"}
        if not verdict["ok"]:
            log.warning("refused a join request from pid %s on %s: %s", request.get("pid"), request.get("host"),
                        verdict["reason"])
            agent.event("refused", pid=request.get("pid"), host=request.get("host"), reason=verdict["reason"])
        agent.store.set(f"join/verdict/{n}", json.dumps(verdict))
        if verdict["ok"]:
            agent.write_workers_json()  # `status` and `scale` see it admitted (it enters the next generation)


def judge(agent, n: int, request: dict) -> dict:
    """Admit the worker of request ``n`` (an agent's, a node agent's, or one started by hand with the
    token), or say why not."""
    wid, pid, node = int(request["id"]), int(request["pid"]), request.get("node")
    if not protocol.verify(agent.token, protocol.join_message(n, wid, pid, node), request.get("mac", "")):
        return {"ok": False, "reason": "wrong or missing job token"}
    cap = agent.cfg.launcher.max_workers
    if cap and len(agent.members) + len(agent.admitted) >= cap:
        return {"ok": False, "reason": f"the job already has launcher.max_workers={cap} workers"}
    worker = agent.joining.pop(wid, None)
    if worker is not None:
        worker.pid = pid  # behind srun, the process we started is srun, not the worker
    elif node is not None and agent.hosts.knows(node, wid):
        worker = agent.hosts.worker(node, wid, pid)  # a node agent's, with the id it drew from the store
    else:
        # Started by someone holding the token (another launcher): give it a fresh id.
        worker = Worker(agent.new_id(), pid, None, request.get("host", "?"))
    worker.state = "admitted"
    worker.host = request.get("host", worker.host)
    agent.admitted.append(worker)
    return {"ok": True, "id": worker.id}
