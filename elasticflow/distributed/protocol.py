"""What the agent and the workers say to each other through the store, and the exit codes they use.

Store keys:
    gen/current                 the newest generation number g
    gen/<g>                     JSON {"members": [worker ids in rank order], "action": "train" | "stop", "reason",
                                "waiting": [ids alive but left out: they re-enter a later generation]}
    gen/<g>/arrived/<id>        a worker is ready to build generation g's group (members build once all arrived;
                                a waiting worker's arrival asks the agent to let it in again)
    gen/<g>/formed/<id>         a member built generation g's group
    gen/<g>/failed/<id>         a member's report that building g's group, or a collective of g, failed
    join/count                  join requests so far (a counter); join/request/<n> is request n (JSON)
    join/verdict/<n>            the agent's answer: {"ok": true, "id": assigned id} or {"ok": false, "reason"}
    worker/<id>/hb              heartbeat counter, bumped by the worker's membership thread
    worker/<id>/device          where the worker computes, ``Placement.describe()`` ("cuda:1 (NVIDIA A100), bf16
                                mixed, nccl"); set once its device is chosen, read by `elasticflow status`
    worker/<id>/memory          the worker's resident MiB, set by its membership thread every few seconds; rank 0's
                                thread reads its members' into the step records (``memory_mib``)
    control/scale               a signed request from `elasticflow scale` (JSON); one slot: a client sets it only
                                while absent (compare_set), the agent deletes it once read
    gen<g>/...                  the gloo rendezvous of generation g (PrefixStore, see comm.py)

The job token never crosses the wire: requests carry an HMAC of their fields keyed by it.
"""
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any, Dict

ENV_STORE = "ELASTICFLOW_STORE"            # host:port of the agent's TCPStore
ENV_WORKER_ID = "ELASTICFLOW_WORKER_ID"    # the id the agent assigned when it spawned this worker
ENV_RUN_DIR = "ELASTICFLOW_RUN_DIR"
ENV_LOCAL_WORKERS = "ELASTICFLOW_LOCAL_WORKERS"
ENV_TOKEN = "ELASTICFLOW_TOKEN"
ENV_BIND = "ELASTICFLOW_BIND"              # the address gloo listens on ("auto": see worker.bind_address)
ENV_SPAWNED_AT = "ELASTICFLOW_SPAWNED_AT"  # time.time() when the agent started the worker (start-up cost)
ENV_LOCAL_SLOT = "ELASTICFLOW_LOCAL_SLOT"    # the worker's slot on its host: which GPU it binds (devices.py)
ENV_DEBUG = "ELASTICFLOW_DEBUG"            # "1": tracebacks, not one line; set by `--debug`, inherited by children

EXIT_OK = 0
EXIT_INTERRUPTED = 130
EXIT_BELOW_MIN = 3      # fewer than launcher.min_workers for elastic.wait_s: checkpoint written, job stopped
EXIT_AGENT_LOST = 4     # the agent (job master) vanished: checkpoint written where possible
EXIT_REMOVED = 5        # the agent retired this worker (scale-down): a clean exit
EXIT_REFUSED = 6        # the agent refused this worker's join (wrong or missing token)


class CommError(RuntimeError):
    """A collective failed or timed out: a peer died, hung, or the group was rebuilt."""


def generation_key(g: int) -> str:
    return f"gen/{g}"


def device_key(worker_id: int) -> str:
    return f"worker/{worker_id}/device"


def memory_key(worker_id: int) -> str:
    return f"worker/{worker_id}/memory"


def encode(members, action: str = "train", reason: str = "", waiting=()) -> str:
    return json.dumps({"members": list(members), "action": action, "reason": reason, "waiting": list(waiting)})


def decode(raw: Any) -> Dict[str, Any]:
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def sign(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def verify(token: str, message: str, mac: str) -> bool:
    return hmac.compare_digest(sign(token, message), str(mac))


def new_token(run_dir: Path) -> str:
    """A random per-job token, stored in RUN_DIR/.elasticflow/token readable by the owner only."""
    token = secrets.token_hex(32)
    path = Path(run_dir) / ".elasticflow" / "token"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read_token(run_dir: Path) -> str:
    return (Path(run_dir) / ".elasticflow" / "token").read_text().strip()


def agent_file(run_dir: Path) -> Path:
    """RUN_DIR/.elasticflow/agent.json: where the running agent's store listens, and its pid."""
    return Path(run_dir) / ".elasticflow" / "agent.json"
