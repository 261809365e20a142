"""What the agent and the workers say to each other through the store, and the exit codes they use.

Store keys:
    gen/current             the newest generation number g
    gen/<g>                 JSON {"members": [worker ids in rank order], "action": "train" | "stop", "reason": str}
    worker/<id>/pid         written by a worker when it starts
    gen<g>/...              the gloo rendezvous of generation g (PrefixStore, see comm.py)
"""
import json
from typing import Any, Dict

ENV_STORE = "ELASTICFLOW_STORE"            # host:port of the agent's TCPStore
ENV_WORKER_ID = "ELASTICFLOW_WORKER_ID"
ENV_RUN_DIR = "ELASTICFLOW_RUN_DIR"
ENV_LOCAL_WORKERS = "ELASTICFLOW_LOCAL_WORKERS"

EXIT_OK = 0
EXIT_INTERRUPTED = 130
EXIT_BELOW_MIN = 3      # fewer than launcher.min_workers for elastic.wait_s: checkpoint written, job stopped
EXIT_AGENT_LOST = 4     # the agent (job master) vanished: checkpoint written where possible
EXIT_REMOVED = 5        # the agent dropped this worker from the membership


class CommError(RuntimeError):
    """A collective failed or timed out: a peer died, hung, or the group was rebuilt."""


def generation_key(g: int) -> str:
    return f"gen/{g}"


def encode(members, action: str = "train", reason: str = "") -> str:
    return json.dumps({"members": list(members), "action": action, "reason": reason})


def decode(raw: bytes) -> Dict[str, Any]:
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
