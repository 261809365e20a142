"""The agent's side of the other hosts (launcher=nodes): node agents register, report their workers'
exits, and receive the signals the agent sends those workers. node_agent.py is the other side.

Store keys (every record signed with the job token, as join requests are):
    node/count, node/request/<n>    a node agent asks to take part: {"name", "pid", "mac"}
    node/verdict/<n>                {"ok", "run_dir", "checkpoint_dir", "probe"} or {"ok": false, "reason"}
    node/exits, node/exit/<k>       a node's worker exited: {"node", "worker", "code", "mac"}
    node/<name>/signals, node/<name>/signal/<k>   the agent asks node <name> to signal a worker: {"worker", "signal"}
    node/<name>/hb                  the node agent's heartbeat counter

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

from ..paths import checkpoint_dir
from . import protocol
from .process import Worker

log = logging.getLogger("elasticflow")
# A node agent beats every 50 ms (node_agent.STORE_S). Silent this long while its workers' peers report
# failed collectives, its host is taken for down (agent._check_health cuts its workers out at once, not
# after the report grace): the powered-off or cut-off host's cost, beside a killed worker's ~50 ms.
NODE_SILENT_S = 1.0


def node_message(n: int, name: str, pid: int) -> str:
    return f"node:{n}:{name}:{pid}"


def exit_message(node: str, worker: int, code: int, k: int) -> str:
    return f"exit:{k}:{node}:{worker}:{code}"


class Hosts:
    """The node agents the agent knows, by host name."""

    def __init__(self, agent):
        self.agent = agent
        self.nodes: Dict[str, int] = {}       # host name -> its node agent's pid
        self.beats: Dict[str, tuple] = {}     # host name -> (its heartbeat counter, when it last moved)
        self.outbox: List[tuple] = []         # (node, worker id, signal) for Worker.signal, sent by serve()
        self.requests = protocol.Inbox("node/count", "node/request")
        self.exits = protocol.Inbox("node/exits", "node/exit")

    def knows(self, node: str, worker_id: int) -> bool:
        return node in self.nodes and 0 <= worker_id < int(self.agent.store.add(protocol.IDS_KEY, 0))

    def worker(self, node: str, worker_id: int, pid: int) -> Worker:
        return Worker(worker_id, pid, None, host=node, node=node, outbox=self.outbox)

    def silent(self, node: str, now: float) -> bool:
        """Whether ``node``'s agent has not beaten for NODE_SILENT_S (its host is down or cut off)."""
        return node in self.beats and now - self.beats[node][1] > NODE_SILENT_S

    def serve(self) -> None:
        """One round: registrations, exit reports, queued signals (the agent's loop, every REQUESTS_S)."""
        store = self.agent.store
        now = time.monotonic()
        for name in self.nodes:
            beats = int(store.add(f"node/{name}/hb", 0))
            if beats != self.beats.get(name, (None,))[0]:
                self.beats[name] = (beats, now)
        for n, request in self.requests.read(store):
            store.set(f"node/verdict/{n}", json.dumps(self._judge(n, request)))
        for k, report in self.exits.read(store):
            self._exited(k, report)
        while self.outbox:
            node, worker_id, sig = self.outbox.pop(0)
            k = int(store.add(f"node/{node}/signals", 1))
            store.set(f"node/{node}/signal/{k}", json.dumps({"worker": worker_id, "signal": sig}))

    def _judge(self, n: int, request: dict) -> dict:
        agent = self.agent
        name, pid = str(request.get("name", "?")), request.get("pid")
        if not protocol.verify(agent.token, node_message(n, name, pid), request.get("mac", "")):
            log.warning("refused node agent pid %s on %s: wrong or missing job token", pid, name)
            agent.event("refused", host=name, pid=pid, reason="node agent with a wrong or missing job token")
            return {"ok": False, "reason": "wrong or missing job token (launcher.token_file or $ELASTICFLOW_JOB_TOKEN "
                                           "must hold the same secret on every host)"}
        # Files the node must see where this host wrote them: the run directory (the config its workers read,
        # their logs, the result) and checkpoint.dir (every worker's shards). node_agent.check_shared reads them.
        probe = secrets.token_hex(8)
        ckpt = checkpoint_dir(agent.cfg, agent.run_dir).absolute()  # the path every host must see
        for directory in (agent.state_dir / "hosts", ckpt):
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f".probe-{name}-{probe}").write_text(probe)
        self.nodes[name] = pid
        self.beats[name] = (-1, time.monotonic())
        agent.event("node", host=name, pid=pid)
        log.info("host %s joined the job (node agent pid %s)", name, pid)
        return {"ok": True, "run_dir": str(agent.run_dir), "checkpoint_dir": str(ckpt), "probe": probe}

    def _exited(self, k: int, report: dict) -> None:
        agent = self.agent
        try:
            node, worker_id, code = str(report["node"]), int(report["worker"]), int(report["code"])
        except (KeyError, TypeError, ValueError):
            return
        if not protocol.verify(agent.token, exit_message(node, worker_id, code, k), report.get("mac", "")):
            agent.event("refused", host=node, reason=f"exit report for worker {worker_id} with a wrong job token")
            return
        for w in agent.live():
            if w.id == worker_id and w.node == node:
                w.exit_code = code  # the agent's next _reap treats it as a child's exit
                return

