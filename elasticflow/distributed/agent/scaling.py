"""The agent's side of `elasticflow scale`: signed requests in the store (control/count, control/request/<n>),
a sealed reply keyed by each request's nonce.

Scaling up spawns workers, who enter through the ordinary join; scaling down retires workers at a
step boundary (they are left out of the next generation and exit 5). control.py is the client side.
"""
from __future__ import annotations

import json
import signal
import time
from typing import Any, Callable, Dict, Optional

from .. import protocol
from . import workers_json
from .state import AgentState


FRESH_S = 300.0   # a scale request older (or newer, by the requester's clock) than this is refused: a replay
NONCES_KEPT = 4096  # nonces remembered (a request is taken once); older ones are past FRESH_S anyway
MAX_WORKERS = 4096  # without launcher.max_workers: a bound all the same (each worker is a process we start)


def scale_message(job: str, target: int, nonce: str, at: float) -> str:
    return f"scale:{job}:{target}:{nonce}:{at!r}"


class Scaling:
    """The scale requests of the job in ``state``; ``spawn()`` starts one more worker (processes.Processes.spawn).
    Owns the request inbox and the nonces taken."""

    def __init__(self, state: AgentState, spawn: Callable[[], Any]):
        self.state, self.spawn = state, spawn
        self.requests = protocol.Inbox("control/count", "control/request")
        self.nonces: Dict[str, None] = {}  # taken once, oldest first

    def serve(self, capacity=None) -> None:
        """Answer the `elasticflow scale` requests written since the last round (the agent calls this every round).
        A request is anyone's to write: each is checked (types, MAC, job, time, nonce) and answered on its own.
        ``capacity``: the launcher's source of more hosts (``Agent.capacity``), or None."""
        state = self.state
        for _, req in self.requests.read(state.store):
            nonce = req.get("nonce")
            if not (isinstance(nonce, str) and 0 < len(nonce) <= 64 and nonce.isalnum()):
                protocol.REFUSED("scale request", "no usable nonce")
                continue  # nowhere to answer
            try:
                reply = self.rescale(req, capacity)
            except Exception as exc:  # noqa: BLE001 - never fatal to the agent (rescale raises only past the MAC check)
                reply = {"ok": False,
                         "reason": f"the agent could not act on it ({type(exc).__name__}: {str(exc)[:200]})"}
            if reply is None:
                # Unanswered: a refusal at control/reply/<nonce> for a request anyone may write (copying a real
                # request's nonce, or replaying it) would overwrite or pre-empt the real request's answer.
                continue
            key = f"control/reply/{nonce}"
            protocol.put(state.store, state.verdicts, key, json.dumps(reply))

    def rescale(self, req: dict, capacity=None) -> Optional[dict]:
        """Check a scale request, then start workers, or retire the surplus (waiting, joining, admitted, then
        the last-joined members). Returns the reply for the requester; None (no reply) for a request that does not
        verify or was taken before. ``capacity.rescale(state, target)`` answers first (launchers/slurm_grow.py)."""
        state = self.state
        target, nonce, at = req.get("workers"), req["nonce"], req.get("time")
        if not (type(target) is int and isinstance(at, float)
                and protocol.verify(state.token, scale_message(state.job, target, nonce, at), req.get("mac"))):
            protocol.REFUSED("scale request", "wrong or missing job token")  # the first of a flood is an event
            return None
        if nonce in self.nonces or abs(time.time() - at) > FRESH_S:
            protocol.REFUSED("scale request", "replayed (its nonce was taken, or it is older than "
                                              f"{FRESH_S:g}s)")
            return None
        self.nonces[nonce] = None
        while len(self.nonces) > NONCES_KEPT:
            self.nonces.pop(next(iter(self.nonces)))
        lc = state.cfg.launcher
        if target < max(1, lc.min_workers):
            return {"ok": False, "reason": f"{target} is below launcher.min_workers={lc.min_workers}"}
        if target > (lc.max_workers or MAX_WORKERS):
            return {"ok": False, "reason": f"{target} is above launcher.max_workers={lc.max_workers or MAX_WORKERS}"}
        state.event("scale", requested=target, current=state.target_workers(), generation=state.generation)
        coming = 0
        if capacity is not None:  # the hosts the launcher adds or gives back come first (worker jobs)
            coming = capacity.rescale(state, target)
            if isinstance(coming, str):
                return {"ok": False, "reason": coming}
        current = state.target_workers() + coming  # workers on their way count as here
        if target > current:
            for _ in range(target - current):
                self.spawn()
        elif target < current:
            self._retire(current - target)
        workers_json.write(state)
        return {"ok": True, "workers": target}

    def _retire(self, surplus: int) -> None:
        state = self.state
        while surplus and state.waiting:  # not in the generation: they leave at the next publish
            state.roster.move(state.waiting[-1], "retiring")
            state.dirty = True
            surplus -= 1
        for w in sorted(state.joining.values(), key=lambda w: -w.id)[:surplus]:  # cancel starts first
            state.roster.drop(w)
            w.signal(signal.SIGKILL)
            surplus -= 1
        while surplus and state.admitted:
            w = state.admitted[-1]
            state.roster.drop(w)
            w.signal(signal.SIGKILL)
            surplus -= 1
        if surplus:
            # The last-joined members leave, trainers before aggregators (parameter servers: an aggregator's
            # shard would have to move first); the rest keep their relative order.
            order = sorted(state.members[::-1], key=lambda w: _aggregator(state.store, w.id))
            leaving = order[:surplus]
            state.roster.move_all([w for w in state.members if w in leaving], "retiring")
            state.dirty = True


def _aggregator(store, worker_id: int) -> bool:
    """Whether the worker said it is a parameter server's aggregator (``Membership.report_role``)."""
    key = protocol.role_key(worker_id)
    try:
        return protocol.read(store, key) == b"aggregator"  # never get(): it waits for a missing key
    except Exception:
        return False
