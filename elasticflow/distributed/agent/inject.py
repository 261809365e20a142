"""The agent's side of `elasticflow inject`: a fault caused on purpose, to rehearse a run's recovery.

Requests come as `elasticflow scale`'s do (scaling.py): signed with the job token in the store (inject/count,
inject/request/<n>), each answered once by its nonce with a sealed reply (inject/reply/<nonce>); control.py is the
client side. The agent acts on the member at that rank in the published generation:

- ``kill``: SIGKILL, as a crashed worker; the survivors regroup.
- ``hang``: SIGSTOP: the process stays, its heartbeat stops, and the health round cuts it out as a hung worker
  after ``elastic.heartbeat_timeout_s`` (health.py SIGKILLs it).
- ``slow``: a sealed record ``worker/<id>/slow`` ({factor, until, nonce}) that the worker reads at its step
  boundaries (train/slowdown.py) and sleeps (factor - 1) x its micro-batches' time in each step, as a slow
  device would (train/balance.py measures it). ``factor`` 1 ends it.
- ``bitflip``: a sealed record ``worker/<id>/flip`` ({bit, tensor, nonce}; the bit rides as ``factor``) that the
  worker reads as it does the slow one, and flips that bit of element 0 of that parameter in its replica
  (train/fingerprint.py), which the members' fingerprints then catch.
"""
from __future__ import annotations

import json
import signal
import time
from typing import Dict, Optional

from .. import protocol
from .process import HOSTNAME, Worker
from .scaling import FRESH_S, NONCES_KEPT
from .state import AgentState

ACTIONS = ("kill", "hang", "slow", "bitflip")
MAX_TENSOR_NAME = 200
COUNT_KEY, REQUEST_PREFIX = "inject/count", "inject/request"
READ_S = 0.25  # how often the inbox is read (a drill waits <= 250 ms): a store round trip each, which every request
               # round (agent.REQUESTS_S) would add to the agent's CPU while training
MAX_FACTOR = 100.0  # a worker 100x slower is as good as hung: --hang says so more plainly


def message(job: str, action: str, rank: int, factor: float, for_s: float, nonce: str, at: float,
            tensor: str = "") -> str:
    return f"inject:{job}:{action}:{rank}:{factor!r}:{for_s!r}:{nonce}:{at!r}" + (f":{tensor}" if tensor else "")


def reply_key(nonce: str) -> str:
    return f"inject/reply/{nonce}"


def slow_key(worker_id: int) -> str:
    return f"worker/{worker_id}/slow"


def flip_key(worker_id: int) -> str:
    return f"worker/{worker_id}/flip"


def drill_key(worker_id: int) -> str:
    """The nonce of the newest drill asked of the worker: the one record it polls (train/slowdown.py ``Drills``),
    reading the drills' own records only when it changed."""
    return f"worker/{worker_id}/drill"


class Injection:
    """The inject requests of the job in ``state``. Owns its inbox and the nonces taken."""

    def __init__(self, state: AgentState):
        self.state = state
        self.requests = protocol.Inbox(COUNT_KEY, REQUEST_PREFIX)
        self.nonces: Dict[str, None] = {}
        self.next_read = 0.0

    def serve(self) -> None:
        """Answer the requests written since the last round (the agent calls this every request round)."""
        state, now = self.state, time.monotonic()
        if now < self.next_read:
            return
        self.next_read = now + READ_S
        for _, req in self.requests.read(state.store):
            nonce = req.get("nonce")
            if not (isinstance(nonce, str) and 0 < len(nonce) <= 64 and nonce.isalnum()):
                protocol.REFUSED("inject request", "no usable nonce")
                continue
            try:
                reply = self.act(req)
            except Exception as exc:  # noqa: BLE001 - never fatal to the agent (act raises only past the MAC check)
                reply = {"ok": False,
                         "reason": f"the agent could not act on it ({type(exc).__name__}: {str(exc)[:200]})"}
            if reply is not None:  # unanswered when it does not verify: as scaling.Scaling.serve says why
                protocol.put(state.store, state.verdicts, reply_key(nonce), json.dumps(reply))

    def act(self, req: dict) -> Optional[dict]:
        """Check one request and cause its fault; the reply for the requester (None: no reply, it does not verify
        or was taken before)."""
        state = self.state
        action, rank, factor, for_s = req.get("action"), req.get("rank"), req.get("factor"), req.get("for_s")
        nonce, at, tensor = req["nonce"], req.get("time"), req.get("tensor", "")
        if not (action in ACTIONS and type(rank) is int and isinstance(factor, float) and isinstance(for_s, float)
                and isinstance(at, float) and isinstance(tensor, str) and len(tensor) <= MAX_TENSOR_NAME
                and protocol.verify(state.token, message(state.job, action, rank, factor, for_s, nonce, at, tensor),
                                    req.get("mac"))):
            protocol.REFUSED("inject request", "wrong or missing job token")
            return None
        if nonce in self.nonces or abs(time.time() - at) > FRESH_S:
            protocol.REFUSED("inject request", f"replayed (its nonce was taken, or it is older than {FRESH_S:g}s)")
            return None
        self.nonces[nonce] = None
        while len(self.nonces) > NONCES_KEPT:
            self.nonces.pop(next(iter(self.nonces)))
        members = state.members
        if not 0 <= rank < len(members):
            ranks = f"ranks 0-{len(members) - 1}" if members else "no ranks yet: it is still forming"
            return {"ok": False, "reason": f"rank {rank} does not exist: generation {state.generation} has "
                                           f"{len(members)} member(s), {ranks}"}
        w = members[rank]
        why = _unreachable(w, action)
        if why:
            return {"ok": False, "reason": why}
        if action == "slow":
            if not 1.0 <= factor <= MAX_FACTOR:
                return {"ok": False, "reason": f"--factor must be within 1..{MAX_FACTOR:g}, got {factor:g}"}
            until = time.time() + for_s if for_s > 0 else None
            state.put(slow_key(w.id), json.dumps({"factor": factor, "until": until, "nonce": nonce}))
        elif action == "bitflip":
            if not (factor.is_integer() and 0 <= factor <= 31):
                return {"ok": False, "reason": f"--bit must be 0..31 (a float32's bits), got {factor:g}"}
            state.put(flip_key(w.id), json.dumps({"bit": int(factor), "tensor": tensor, "nonce": nonce}))
        if action in ("slow", "bitflip"):
            state.put(drill_key(w.id), nonce)
        else:
            w.signal(signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        extra = {"factor": factor, "for_s": for_s or None} if action == "slow" else \
            {"bit": int(factor), "tensor": tensor or None} if action == "bitflip" else {}
        state.event("inject", action=action, rank=rank, worker=w.id, pid=w.pid, host=w.host,
                    generation=state.generation, **extra)
        return {"ok": True, "action": action, **w.describe(rank), **extra}


def _unreachable(w: Worker, action: str) -> str:
    """Why the agent cannot cause ``action`` on ``w`` ('' when it can): a worker started by hand on another host
    has no pid here, and srun forwards SIGUSR1 and TERM only (process.Worker.signal)."""
    if action in ("slow", "bitflip") or w.node is not None or w.host == HOSTNAME:
        return ""
    if w.proc is None:
        return f"worker {w.id} runs on {w.host}, started there by hand: the agent cannot signal it"
    return "" if action == "kill" else (f"worker {w.id} runs on {w.host} behind srun, which forwards no SIGSTOP: "
                                        "use --kill or --slow")
