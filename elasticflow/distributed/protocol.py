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
    worker/ids                  the counter worker ids are drawn from (the agent's and node agents' workers)
    node/...                    node agents (launcher=nodes): their requests, exit reports and signals (hosts.py)
    worker/<id>/hb              heartbeat counter, bumped by the worker's membership thread
    worker/<id>/exit            the worker's exit code, set as it exits (a clean exit counts only with it)
    worker/<id>/cut             why the agent cut this worker out (it stopped heartbeating, or never reported)
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
from typing import Any, Dict, Iterator, List

# The environment variables between the agent and its workers live in a leaf (devices.py reads one too).
from ..envnames import (ENV_BIND, ENV_DEBUG, ENV_JOB_TOKEN, ENV_LOCAL_SLOT, ENV_LOCAL_WORKERS,  # noqa: F401
                        ENV_NODE, ENV_RUN_DIR, ENV_SPAWNED_AT, ENV_STORE, ENV_TOKEN, ENV_WORKER_ID)

IDS_KEY = "worker/ids"  # worker ids are drawn from this counter, by the agent and by node agents

EXIT_OK = 0
EXIT_INTERRUPTED = 130
EXIT_BELOW_MIN = 3      # fewer than launcher.min_workers for elastic.wait_s: checkpoint written, job stopped
EXIT_AGENT_LOST = 4     # the agent (job master) vanished: checkpoint written where possible
EXIT_REMOVED = 5        # the agent retired this worker (scale-down): a clean exit
EXIT_REFUSED = 6        # the agent refused this worker's join (wrong or missing token)
EXIT_CUT_OUT = 7        # the agent cut this worker out (silent: hung, or its host cut off); a fresh one may rejoin


class CommError(RuntimeError):
    """A collective failed or timed out: a peer died, hung, or the group was rebuilt."""


def generation_key(g: int) -> str:
    return f"gen/{g}"


def exit_key(worker_id: int) -> str:
    """Set by a worker as it exits: its exit code. Behind srun the agent sees srun's code, which is 0 also when
    the step's node failed; a clean code counts only with this record (agent._reap)."""
    return f"worker/{worker_id}/exit"


def cut_key(worker_id: int) -> str:
    """Set by the agent when it cuts a worker out: why. The worker, if it lives to read it, exits 7."""
    return f"worker/{worker_id}/cut"


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


def join_message(n: int, worker_id: int, pid: int, node=None) -> str:
    """What a join request's HMAC covers (a node agent's worker signs its node's name too)."""
    return f"{n}:{worker_id}:{pid}" + ("" if node is None else f":{node}")


def new_token(run_dir: Path, token: str = None) -> str:
    """The job's token (``token``, or a new random one), stored in RUN_DIR/.elasticflow/token readable by the
    owner only: `elasticflow scale` and `status` read it there."""
    token = token or secrets.token_hex(32)
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


class Inbox:
    """Records ``<prefix>/<n>`` counted by ``count_key``, read as they are written, in any order: a writer
    that died between counting and writing holds up no one behind it (the agent's joins work the same way)."""

    def __init__(self, count_key: str, prefix: str):
        self.count_key, self.prefix = count_key, prefix
        self.seen = 0
        self.unread: List[int] = []

    def read(self, store) -> Iterator[tuple]:
        count = int(store.add(self.count_key, 0))
        self.unread += range(self.seen + 1, count + 1)
        self.seen = count
        for n in list(self.unread):
            key = f"{self.prefix}/{n}"
            if not store.check([key]):
                continue
            self.unread.remove(n)
            try:
                yield n, decode(store.get(key))
            except ValueError:
                yield n, {}
