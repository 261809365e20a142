"""The agent's side of `elasticflow scale`: a signed request in the store, a reply keyed by its nonce.

Scaling up spawns workers, who enter through the ordinary join; scaling down retires workers at a
step boundary (they are left out of the next generation and exit 5). control.py is the client side.
"""
from __future__ import annotations

import json
import signal

from . import protocol


def serve(agent) -> None:
    """Answer a pending `elasticflow scale` request, if any (the agent calls this every round)."""
    if not agent.store.check(["control/scale"]):
        return
    raw = agent.store.get("control/scale")
    agent.store.delete_key("control/scale")
    try:
        req = protocol.decode(raw)
        reply = rescale(agent, req)
    except (ValueError, KeyError) as exc:
        req, reply = {}, {"ok": False, "reason": f"malformed scale request ({exc})"}
    agent.store.set(f"control/reply/{req.get('nonce', 'none')}", json.dumps(reply))


def rescale(agent, req: dict) -> dict:
    """Check a scale request, then start workers, or retire the surplus (waiting, joining, admitted, then
    the last-joined members). Returns the reply for the requester."""
    target, nonce = int(req["workers"]), str(req["nonce"])
    if not protocol.verify(agent.token, f"scale:{target}:{nonce}", req.get("mac", "")):
        agent.event("refused", reason="scale request with a wrong or missing job token")
        return {"ok": False, "reason": "wrong or missing job token"}
    lc = agent.cfg.launcher
    if target < max(1, lc.min_workers):
        return {"ok": False, "reason": f"{target} is below launcher.min_workers={lc.min_workers}"}
    if lc.max_workers and target > lc.max_workers:
        return {"ok": False, "reason": f"{target} is above launcher.max_workers={lc.max_workers}"}
    current = agent.target_workers()
    agent.event("scale", requested=target, current=current, generation=agent.generation)
    if target > current:
        for _ in range(target - current):
            agent.spawn()
    elif target < current:
        surplus = current - target
        while surplus and agent.waiting:  # not in the generation: they leave at the next publish
            w = agent.waiting.pop()
            w.state = "retiring"
            agent.retiring.append(w)
            agent.dirty = True
            surplus -= 1
        for w in sorted(agent.joining.values(), key=lambda w: -w.id)[:surplus]:  # cancel starts first
            agent.joining.pop(w.id)
            w.signal(signal.SIGKILL)
            surplus -= 1
        while surplus and agent.admitted:
            agent.admitted.pop().signal(signal.SIGKILL)
            surplus -= 1
        if surplus:
            # The last-joined members leave; the rest keep their relative order.
            leaving, agent.members = agent.members[-surplus:], agent.members[:-surplus]
            for w in leaving:
                w.state = "retiring"
            agent.retiring += leaving
            agent.dirty = True
    agent.write_workers_json()
    return {"ok": True, "workers": target}
