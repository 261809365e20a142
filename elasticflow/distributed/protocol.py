"""What the agent and the workers say to each other through the store, and the exit codes they use.

Store keys (every record a worker or the agent acts on is sealed with the job token: _util/sealing.py):
    gen/current                 the newest generation number g (sealed)
    gen/<g>                     sealed JSON {"members": [worker ids in rank order], "action": "train" | "stop",
                                "reason", "waiting": [ids alive but left out: they re-enter a later generation]}
    gen/<g>/arrived/<id>        a worker is ready to build generation g's group (members build once all arrived;
                                a waiting worker's arrival asks the agent to let it in again)
    gen/<g>/go                  the agent saw every member of g arrive (sealed): what members of a large generation
                                wait for, instead of reading every member's arrival (membership/rendezvous.py)
    gen/<g>/formed/<id>         a member built generation g's group
    gen/<g>/failed/<id>         a member's report that building g's group, or a collective of g, failed
    join/count                  join requests so far (a counter); join/request/<n> is request n (JSON, its own MAC)
    join/verdict/<n>            the agent's answer, sealed with the token and bound to the request's nonce:
                                {"ok": true, "id": assigned id, "job": the run's job id} or {"ok": false, "reason"}
    worker/ids                  the counter worker ids are drawn from (the agent's and node agents' workers)
    node/...                    node agents (launcher=nodes): their requests, exit reports and signals (agent/hosts.py)
    worker/<id>/hb              heartbeat: a sealed sequence number, set by the worker's membership thread
    worker/<id>/exit            the worker's exit code, set as it exits (a clean exit counts only with it)
    worker/<id>/cut             why the agent cut this worker out (it stopped heartbeating, or never reported)
    worker/<id>/device          where the worker computes, ``Placement.describe()`` ("cuda:1 (NVIDIA A100), bf16
                                mixed, nccl"); set once its device is chosen, read by `elasticflow status`
                                (shown only: the one record not sealed)
    worker/<id>/memory          the worker's resident MiB, set by its membership thread every few seconds; rank 0's
                                thread reads its members' into the step records (``memory_mib``)
    control/count               scale requests so far; control/request/<n> is request n from `elasticflow scale`
                                (JSON, its own MAC over the job id, a nonce and the time; a nonce is taken once)
    control/reply/<nonce>       the agent's sealed answer
    gen<g>-<tag>/...            the gloo rendezvous of generation g (PrefixStore, see comm/comm.py); <tag> is derived
                                from the token, so a stranger cannot address it

The job token never crosses the wire: requests carry an HMAC of their fields keyed by it, records a MAC keyed
by the token and the run's job id (_util/sealing.py). A stranger's record is refused, counted and logged once per kind.
"""
import hashlib
import hmac
import json
import secrets
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from .._util.fileio import write_atomic
from .._util.sealing import REFUSED, Forged, Sealer  # noqa: F401 - the workers' and the agent's sealer
from .._util.untrusted import MAX_RECORD, loads, read  # noqa: F401 - the one reader of what strangers may write

# The environment variables between the agent and its workers live in a leaf (devices.py reads one too).
from .._util.envnames import (ENV_BIND, ENV_DEBUG, ENV_JOB_TOKEN, ENV_LOCAL_SLOT, ENV_LOCAL_WORKERS,
                              ENV_NODE, ENV_RUN_DIR, ENV_SPAWNED_AT, ENV_STORE, ENV_TOKEN, ENV_WORKER_ID)

IDS_KEY = "worker/ids"  # worker ids are drawn from this counter, by the agent and by node agents

EXIT_OK = 0
EXIT_INTERRUPTED = 130
EXIT_BELOW_MIN = 3      # fewer than launcher.min_workers for elastic.wait_s: checkpoint written, job stopped
EXIT_AGENT_LOST = 4     # the agent (job master) vanished: checkpoint written where possible
EXIT_REMOVED = 5        # the agent retired this worker (scale-down): a clean exit
EXIT_REFUSED = 6        # the agent refused this worker's join (wrong or missing token)
EXIT_CUT_OUT = 7        # the agent cut this worker out (silent: hung, or its host cut off); a fresh one may rejoin
EXIT_STRAGGLER = 8      # the members evicted this worker as a straggler (elastic.straggler=evict); a fresh one may join
EXIT_CORRUPT = 9        # the members evicted this worker: its parameters differed from the majority's (fingerprint.py)
EXIT_MISCOMPUTE = 10    # the members evicted this worker: it computed a micro-batch unlike the majority (spot_check.py)


class CommError(RuntimeError):
    """A collective failed or timed out: a peer died, hung, or the group was rebuilt."""


def generation_key(g: int) -> str:
    return f"gen/{g}"


def exit_key(worker_id: int) -> str:
    """Set by a worker as it exits: its exit code. Behind srun the agent sees srun's code, which is 0 also when
    the step's node failed; a clean code counts only with this record (agent/processes.py)."""
    return f"worker/{worker_id}/exit"


def cut_key(worker_id: int) -> str:
    """Set by the agent when it cuts a worker out: why. The worker, if it lives to read it, exits 7."""
    return f"worker/{worker_id}/cut"


def device_key(worker_id: int) -> str:
    return f"worker/{worker_id}/device"


def role_key(worker_id: int) -> str:
    """topology=parameter_server: "aggregator" or "trainer", for the agent to retire trainers first."""
    return f"worker/{worker_id}/role"


def memory_key(worker_id: int) -> str:
    return f"worker/{worker_id}/memory"


def encode(members, action: str = "train", reason: str = "", waiting=(), gone=(), pids=None, causes=None) -> str:
    """A generation's record. ``gone``: members of the one before that the agent declared gone (dead, hung, or
    their host silent), whose peers cut their links at once (membership); not those that retire. ``pids`` (of
    the workers who came or went) and ``causes`` (why each of ``gone`` went), by worker id: the new rank 0's
    console line (observability.reporting.membership_line)."""
    record = {"members": list(members), "action": action, "reason": reason, "waiting": list(waiting),
              "gone": list(gone)}
    if pids:
        record["pids"] = {str(i): pid for i, pid in pids.items()}
    if causes:
        record["causes"] = {str(i): cause for i, cause in causes.items()}
    return json.dumps(record)


def sign(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def verify(token: str, message: str, mac: Any) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(sign(token, message), mac)


def join_message(n: int, worker_id: int, pid: int, node, host: str, nonce: str) -> str:
    """What a join request's HMAC covers: every field the agent acts on (the host and pid name the process
    it may signal; the nonce binds the verdict to this request)."""
    return f"join:{n}:{worker_id}:{pid}:{node}:{host}:{nonce}"


def verdict_key(n: int) -> str:
    return f"join/verdict/{n}"


# ---------------------------------------------------------------- sealed records
def put(store, sealer: Sealer, key: str, payload: str) -> None:
    store.set(key, sealer.seal(key, payload))


def fetch(store, sealer: Sealer, key: str, kind: str) -> Optional[str]:
    """The payload of the sealed record at ``key``; None when absent or forged (refused: counted, logged once
    per ``kind``)."""
    return opened(sealer, key, read(store, key), kind)


def opened(sealer: Sealer, key: str, raw: Optional[bytes], kind: str) -> Optional[str]:
    """The payload of ``raw``, the value read at ``key``; None when absent or forged (refused, as ``fetch``)."""
    if raw is None:
        return None
    try:
        return sealer.open(key, raw)
    except Forged as exc:
        REFUSED(kind, str(exc))
        return None


def fetch_json(store, sealer: Sealer, key: str, kind: str) -> Optional[Dict[str, Any]]:
    payload = fetch(store, sealer, key, kind)
    try:
        value = None if payload is None else loads(payload)
    except ValueError:  # sealed by the job, so never: but a record is never trusted to parse
        value = None
    return value if isinstance(value, dict) else None


def counter(store, key: str, kind: str) -> Optional[int]:
    """A counter's value, read without ``add``: ``add`` on a key a stranger set to text closes this client's
    connection (the store answers with an error and hangs up). 0 when missing, None (refused) unless a number."""
    return _count_of(read(store, key), key, kind)


def _count_of(raw: Optional[bytes], key: str, kind: str) -> Optional[int]:
    if raw is None:
        return 0
    try:
        return int(raw)
    except ValueError:
        REFUSED(kind, f"{key} holds {bytes(raw)[:40]!r}, not a count")
        return None


def draw(store, key: str, kind: str, tries: int = 5) -> int:
    """``add(key, 1)`` on a shared counter: the new count.

    The ``add`` goes over a connection of its own (``store.clone()``), because a stranger may set the counter
    to text at any moment, and ``add`` on text makes the store hang up: then only that throwaway connection is
    lost, the text is put back to the last number we know of, and the draw is tried again.
    """
    for _ in range(tries):
        if counter(store, key, kind) is None:
            store.set(key, str(_last_drawn.get(key, 0)))
        try:
            n = int(store.clone().add(key, 1))
        except Exception:  # noqa: BLE001 - text landed between our read and the add: its connection is gone
            continue
        _last_drawn[key] = n
        return n
    raise CommError(f"could not count at {key}: something keeps writing text there")


_last_drawn: Dict[str, int] = {}


def new_token(run_dir: Path, token: str = None) -> str:
    """The job's token (``token``, or a new random one), stored in RUN_DIR/.elasticflow/token readable by the
    owner only: `elasticflow scale` and `status` read it there."""
    token = token or secrets.token_hex(32)
    write_private(Path(run_dir) / ".elasticflow" / "token", token)
    return token


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only, whatever was there (``fileio.write_atomic`` with
    mode 600: a new file renamed over ``path``, so an existing file's looser mode, or a symlink planted at
    ``path``, is replaced, never written through)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text, mode=0o600)


def read_token(run_dir: Path) -> str:
    return (Path(run_dir) / ".elasticflow" / "token").read_text().strip()


def agent_file(run_dir: Path) -> Path:
    """RUN_DIR/.elasticflow/agent.json: where the running agent's store listens, and its pid."""
    return Path(run_dir) / ".elasticflow" / "agent.json"


class Inbox:
    """Records ``<prefix>/<n>`` counted by ``count_key``, read as they are written, in any order: a writer
    that died between counting and writing holds up no one behind it (the agent's joins work the same way).

    The counter is anyone's to write, so it is not trusted: a count that jumps past ``backlog`` numbers keeps
    only the newest (a real writer counts after whoever inflated it), and a number not filled in within
    ``expire_s`` is dropped. Records are yielded as dicts ({} when not a JSON object); their MACs are the
    reader's to check."""

    def __init__(self, count_key: str, prefix: str, backlog: int = 256, expire_s: float = 60.0):
        self.count_key, self.prefix = count_key, prefix
        self.backlog, self.expire_s = backlog, expire_s
        self.seen = 0
        self.unread: Dict[int, float] = {}  # number -> when it was counted (monotonic)

    def read(self, store) -> Iterator[tuple]:
        count = self._count(store)
        now = time.monotonic()
        if count is not None and count > self.seen:
            first = max(self.seen + 1, count - self.backlog + 1)
            if first > self.seen + 1:
                REFUSED(self.count_key, f"{self.count_key} jumped from {self.seen} to {count}; "
                                        f"only the newest {self.backlog} numbers are read")
            self.unread.update((n, now) for n in range(first, count + 1))
            self.seen = count
        for n, counted in list(self.unread.items()):
            raw = read(store, f"{self.prefix}/{n}")
            if raw is None:
                if now - counted > self.expire_s:
                    del self.unread[n]
                continue
            del self.unread[n]
            try:
                record = loads(raw)
            except ValueError:
                record = {}
            yield n, record if isinstance(record, dict) else {}
        while len(self.unread) > self.backlog:  # numbers a stranger counted and never filled in
            del self.unread[min(self.unread)]

    def _count(self, store) -> Optional[int]:
        """The counter's value; one a stranger deleted, reset or set to text is put back to the count seen, so
        the next writer counts past what was read (a number below it would never be read). compare_set: a
        writer's own add in between wins."""
        raw = read(store, self.count_key)
        count = _count_of(raw, self.count_key, self.count_key)
        if self.seen and (count is None or count < self.seen):
            store.compare_set(self.count_key, b"" if raw is None else raw, str(self.seen))
        return count
