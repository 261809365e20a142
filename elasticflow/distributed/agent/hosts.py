"""The agent's side of the other hosts (launcher=nodes): node agents register, report their workers'
exits, and receive the signals the agent sends those workers. node_agent.py is the other side.

Store keys (every record signed with the job token, as join requests are):
    node/count, node/request/<n>    a node agent asks to take part: {"name", "pid", "nonce", "mac"}
    node/verdict/<n>                sealed with the token, bound to the nonce: {"ok", "job", "run_dir",
                                    "checkpoint_dir", "probe"} or {"ok": false, "reason"}
    node/exits, node/exit/<k>       a node's worker exited: sealed {"node", "worker", "code"}
    node/<name>/signals, node/<name>/signal/<k>   the agent asks node <name> to signal a worker: sealed
                                    {"worker", "signal"}
    node/<name>/hb                  the node agent's heartbeat: a sealed sequence number

A node's workers are ordinary members (they join with the token, heartbeat and report failures like the
agent's own); only their process is not the agent's child, so their exits arrive here (``Worker.exit_code``,
read by the agent's reaping like a child's) and signals to them leave here.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Dict, List

from ..._util.paths import checkpoint_dir
from .. import protocol
from .process import Worker
from .state import AgentState

log = logging.getLogger("elasticflow")
# A node agent beats every 50 ms (node_agent.STORE_S). Silent this long while its workers' peers report
# failed collectives, its host is taken for down (health.Health.check cuts its workers out at once, not
# after the report grace): the powered-off or cut-off host's cost, beside a killed worker's ~50 ms.
NODE_SILENT_S = 1.0


def node_message(n: int, name: str, pid: int, nonce: str) -> str:
    return f"node:{n}:{name}:{pid}:{nonce}"


class Hosts:
    """The node agents the agent knows, by host name."""

    def __init__(self, state: AgentState):
        self.state = state
        self.nodes: Dict[str, int] = {}       # host name -> its node agent's pid
        self.beats: Dict[str, tuple] = {}     # host name -> (its heartbeat counter, when it last moved)
        self.outbox: List[tuple] = []         # (node, worker id, signal) for Worker.signal, sent by serve()
        self.requests = protocol.Inbox("node/count", "node/request")
        self.exits = protocol.Inbox("node/exits", "node/exit")

    def knows(self, node: str, worker_id: int) -> bool:
        return node in self.nodes and 0 <= worker_id < (protocol.counter(self.state.store, protocol.IDS_KEY,
                                                                          protocol.IDS_KEY) or 0)

    def worker(self, node: str, worker_id: int, pid: int) -> Worker:
        return Worker(worker_id, pid, None, host=node, node=node, outbox=self.outbox)

    def silent(self, node: str, now: float) -> bool:
        """Whether ``node``'s agent has not beaten for NODE_SILENT_S (its host is down or cut off)."""
        return node in self.beats and now - self.beats[node][1] > NODE_SILENT_S

    def serve(self) -> None:
        """One round: registrations, exit reports, queued signals (the agent's loop, every REQUESTS_S)."""
        store = self.state.store
        now = time.monotonic()
        for name in self.nodes:
            beat = protocol.fetch(store, self.state.sealer, f"node/{name}/hb", "heartbeat")
            if beat is not None and int(beat) > self.beats[name][0]:  # a replayed beat is an old one
                self.beats[name] = (int(beat), now)
        for n, request in self.requests.read(store):
            try:
                verdict = self._judge(n, request)
            except Exception as exc:  # noqa: BLE001 - anyone can write a request: never fatal to the agent
                verdict = {"ok": False, "reason": f"malformed request ({type(exc).__name__})"}
            nonce = request.get("nonce")
            verdict["nonce"] = nonce if isinstance(nonce, str) else None
            protocol.put(store, self.state.verdicts, f"node/verdict/{n}", json.dumps(verdict))
        for k, _ in self.exits.read(store):
            report = protocol.fetch_json(store, self.state.sealer, f"node/exit/{k}", "node exit report")
            if report is not None:
                self._exited(report)
        while self.outbox:
            node, worker_id, sig = self.outbox.pop(0)
            k = protocol.draw(store, f"node/{node}/signals", "node signals")
            protocol.put(store, self.state.sealer, f"node/{node}/signal/{k}",
                         json.dumps({"worker": worker_id, "signal": sig}))

    def _judge(self, n: int, request: dict) -> dict:
        state = self.state
        name, pid, nonce = request.get("name"), request.get("pid"), request.get("nonce")
        valid = isinstance(name, str) and _plain(name) and type(pid) is int and isinstance(nonce, str)
        if not (valid and protocol.verify(state.token, node_message(n, name, pid, nonce), request.get("mac"))):
            name, pid = str(name)[:64], str(pid)[:20]
            log.warning("refused node agent pid %s on %s: wrong or missing job token", pid, name)
            state.event("refused", host=name, pid=pid, reason="node agent with a wrong or missing job token")
            return {"ok": False, "reason": "wrong or missing job token (launcher.token_file or $ELASTICFLOW_JOB_TOKEN "
                                           "must hold the same secret on every host)"}
        # Files the node must see where this host wrote them: the run directory (the config its workers read,
        # their logs, the result) and checkpoint.dir (every worker's shards). node_agent.check_shared reads them.
        probe = secrets.token_hex(8)
        ckpt = checkpoint_dir(state.cfg, state.run_dir).absolute()  # the path every host must see
        for directory in (state.state_dir / "hosts", ckpt):
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f".probe-{name}-{probe}").write_text(probe)
        self.nodes[name] = pid
        self.beats[name] = (-1, time.monotonic())
        state.event("node", host=name, pid=pid)
        log.info("host %s joined the job (node agent pid %s)", name, pid)
        return {"ok": True, "job": state.job, "run_dir": str(state.run_dir), "checkpoint_dir": str(ckpt),
                "probe": probe}

    def _exited(self, report: dict) -> None:
        """A node agent's sealed report that its worker exited."""
        state = self.state
        node, worker_id, code = report.get("node"), report.get("worker"), report.get("code")
        if not (isinstance(node, str) and type(worker_id) is int and type(code) is int):
            return
        for w in state.live():
            if w.id == worker_id and w.node == node:
                w.exit_code = code  # the next reaping (processes.Processes.reap) treats it as a child's exit
                return



def _plain(name: str) -> bool:
    """A host name usable in store keys and file names: no separators, no control characters."""
    return 0 < len(name) <= 253 and all(c.isalnum() or c in "-_." for c in name) and name not in (".", "..")
