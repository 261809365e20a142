"""Store records sealed with the job's token: whoever can reach the store can write any key, so a record is
acted on only when its MAC verifies.

A sealed record is ``"<mac> <payload>"``: the HMAC-SHA256 of the record's *key* and payload, keyed by a key
derived from the job token (and, for the records of one run, the run's random job id). The key is inside
the MAC, so a record copied to another key (generation 3's to generation 5, worker 1's to worker 2) does not
verify; the job id is, so a record captured in one run does not verify in the next run that shares the
token (``launcher.token_file``). Records that can be replayed within a run carry their own freshness: a
heartbeat's sequence number, a scale request's nonce and time.

A record that fails is ``refused``: ignored, counted by kind, and logged once per kind per process, never
acted on and never fatal. The token itself never crosses the wire.

Note: the MAC authenticates, it does not hide: records (and the gradients gloo sends) travel in clear.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from typing import Callable, Dict, Optional

log = logging.getLogger("elasticflow")
MAC_CHARS = 64  # hex digits of an HMAC-SHA256


class Forged(ValueError):
    """A record that does not verify: absent MAC, wrong key, wrong job, or altered payload."""


def mac(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


class Sealer:
    """Seals and opens the records of one job.

    Args:
        token: the job's shared secret.
        job: the run's job id (random per run, learned from a sealed verdict); "" seals with the token alone
            (the join and node verdicts that hand the job id out, and `elasticflow scale`).
    """

    def __init__(self, token: str, job: str = ""):
        self.token, self.job = token, job
        base = token.encode()
        self._key = bytes.fromhex(mac(base, f"records:{job}")) if job else base

    def for_job(self, job: str) -> "Sealer":
        return Sealer(self.token, job)

    def seal(self, key: str, payload: str) -> str:
        return f"{mac(self._key, key + chr(0) + payload)} {payload}"

    def open(self, key: str, raw) -> str:
        """The payload of the record ``raw`` read at ``key``; raises Forged unless its MAC verifies."""
        text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        tag, _, payload = text.partition(" ")
        if len(tag) != MAC_CHARS or not hmac.compare_digest(tag, mac(self._key, key + chr(0) + payload)):
            raise Forged(f"the record at {key!r} does not verify with the job token")
        return payload

    def name(self, what: str) -> str:
        """A key suffix only token holders can compute: for slots taken first-come (compare_set), which a
        stranger could otherwise take before the job does."""
        return mac(self._key, f"name:{what}")[:16]


class Refusals:
    """Forged records seen by this process, by kind; each kind is logged (and ``on_first``-reported) once."""

    def __init__(self, who: str = ""):
        self.who = who
        self.counts: Dict[str, int] = {}
        self.on_first: Optional[Callable[[str, str], None]] = None  # (kind, detail): e.g. an events.jsonl line
        self._lock = threading.Lock()  # the membership thread and the training thread both read records

    def __call__(self, kind: str, detail: str = "") -> None:
        with self._lock:
            first = kind not in self.counts
            self.counts[kind] = self.counts.get(kind, 0) + 1
        if not first:
            return
        log.warning("%srefused a forged %s record%s; ignored (a process that can reach the job's store but holds "
                    "no token wrote it; later ones are only counted)", f"{self.who}: " if self.who else "", kind,
                    f" ({detail[:160]})" if detail else "")
        if self.on_first is not None:
            try:
                self.on_first(kind, detail[:160])
            except OSError:
                pass  # the report is a courtesy; the refusal itself already happened


REFUSED = Refusals()  # this process's count (a worker's membership and checkpointer share it)
