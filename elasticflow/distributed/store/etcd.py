"""The job's store in an etcd cluster (``launcher.store=etcd``): the job's records replicated by etcd's members, so
that losing a host, the agent's own included, loses none of them; and the agent's leadership, a key held by a
lease (agent/leadership.py).

``EtcdStore`` is a client over etcd's v3 HTTP/JSON gateway, with mutual TLS (a client certificate), on one
keep-alive HTTPS connection per client, with TCPStore's semantics; a worker's is its ``torch.distributed.Store``
twin (dist_store.py), and gloo's rendezvous goes through it as through the other stores. Every key lives under
the job's prefix. A member that does not answer within ``OP_S`` (powered off, cut off, or without a quorum) is
left for the next endpoint; the call fails only when none answers within the store's timeout. ``get``/``wait``
poll (a watch over the gateway would be a second connection per waiter).

A client may be *fenced* (the agent's): its writes are transactions that also compare the leader key with its own
name, so an agent whose lease expired (a long pause, a partition) can write nothing more: ``Deposed``.

With ``user`` (``launcher.etcd.user``) the client logs in as that etcd user (``/v3/auth/authenticate``, its password
read from ``password_file``) and sends the token it gets with every request, logging in again when a member says
the token is no longer valid (etcd's simple tokens lapse after ``--auth-token-ttl``, 300 s, unused). With etcd's
authentication on, the job's user holds a role limited to the job's prefix, so another job's certificate (the same
CA) can neither list, read, write nor delete the job's keys (docs/multi-host.md#another-job-on-the-same-etcd).
etcd 3.4's JSON gateway refuses a client certificate with a CommonName once authentication is on: such a job's
certificate has none.

The address every process is handed (``ENV_STORE``) names it all, the password's file but never the password:
``etcd:endpoints=https%3A%2F%2F10.0.0.1%3A2379,...&prefix=...&ca=...&cert=...&key=...[&user=...&password_file=...]``
(``address``).
"""
from __future__ import annotations

import base64
import datetime
import http.client
import json
import ssl
import threading
import time
from typing import Dict, List, Optional, Tuple
from urllib.parse import parse_qs, urlencode, urlsplit

from .base import Store

SCHEME = "etcd:"
OP_S = 2.0      # one request to one member: no answer by then and the member is taken for down (the next is tried)
POLL_S = 0.005  # get/wait: how often a missing key is read again
RETRY_S = 0.05  # after every endpoint failed once, the pause before the next round


class Deposed(Exception):
    """A fenced write refused: the leader key no longer names this client's owner (its lease expired)."""


class EtcdError(RuntimeError):
    """No member of the cluster answered within the store's timeout (or one refused the request)."""


def address(endpoints: List[str], prefix: str, ca: str, cert: str, key: str, user: str = "",
            password_file: str = "") -> str:
    """The store's address, for ``connect``: the endpoints, the job's key prefix, the TLS files, and the etcd user
    to log in as with its password's file (none: no login)."""
    login = {"user": user, "password_file": password_file} if user else {}
    return SCHEME + urlencode({"endpoints": ",".join(endpoints), "prefix": prefix, "ca": ca, "cert": cert, "key": key,
                               **login})


def parse(addr: str) -> Dict[str, str]:
    fields = {k: v[0] for k, v in parse_qs(addr[len(SCHEME):], keep_blank_values=True).items()}
    missing = [k for k in ("endpoints", "prefix", "ca", "cert", "key") if k not in fields]
    if missing:
        raise ValueError(f"etcd store address lacks {', '.join(missing)}: {addr[:200]}")
    return fields


def first_endpoint(addr: str):
    """The first member's URL (urlsplit): where gloo looks for the route toward the job's store."""
    return urlsplit(parse(addr)["endpoints"].split(",")[0])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def range_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix`` (etcd's ``--prefix``)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


class EtcdStore(Store):
    """A client of the job's records in etcd (TCPStore's semantics); ``fence``: (key, value) every write needs."""

    def __init__(self, addr: str, timeout: datetime.timedelta, fence: Optional[Tuple[str, str]] = None):
        super().__init__()
        fields = parse(addr)
        self.addr, self.fence = addr, fence
        self.endpoints = [urlsplit(e) for e in fields["endpoints"].split(",") if e]
        self.prefix = fields["prefix"].encode()
        self._context = ssl.create_default_context(cafile=fields["ca"])
        self._context.load_cert_chain(fields["cert"], fields["key"])
        self._conn: Optional[http.client.HTTPSConnection] = None
        self._at = 0  # the endpoint in use: kept while it answers
        self.user, self._password_file = fields.get("user") or None, fields.get("password_file", "")
        self._auth: Optional[str] = None  # the login's token (``user``), sent with every request
        self._lock = threading.Lock()
        self.set_timeout(timeout)

    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        self.timeout_s = timeout.total_seconds()

    def clone(self) -> "EtcdStore":
        return type(self)(self.addr, datetime.timedelta(seconds=self.timeout_s), self.fence)

    # ---------------------------------------------------------------- one request, to whichever member answers
    def post(self, path: str, body: dict) -> dict:
        with self._lock:  # one connection, one request at a time: a second thread would read the first's reply
            return self._post(path, body)

    def _post(self, path: str, body: dict) -> dict:
        deadline, last = time.monotonic() + self.timeout_s, ""
        while True:
            for _ in range(len(self.endpoints)):
                try:
                    if self._conn is None:
                        url = self.endpoints[self._at]
                        self._conn = http.client.HTTPSConnection(url.hostname, url.port or 2379,
                                                                 context=self._context, timeout=OP_S)
                    if self.user and self._auth is None:
                        self._auth = self._login()
                    headers = {"Content-Type": "application/json", **({"Authorization": self._auth} if self.user
                                                                      else {})}
                    self._conn.request("POST", path, json.dumps(body), headers)
                    reply = self._conn.getresponse()
                    data = reply.read()
                    if reply.status == 200:
                        return json.loads(data)
                    last = f"{reply.status} {data[:160]!r}"
                    if self.user and reply.status == 401 and b"invalid auth token" in data:
                        self._auth = None  # lapsed (unused for --auth-token-ttl): log in again, same member
                        continue
                    if 400 <= reply.status < 500:  # our request is wrong: no other member would take it
                        raise EtcdError(f"etcd refused {path}: {last}")
                except (OSError, http.client.HTTPException) as exc:  # down, cut off, or a connection we cut
                    last = f"{type(exc).__name__}: {exc}"
                self.close()  # this member failed us (or has no leader: 5xx): the next one
                self._at = (self._at + 1) % len(self.endpoints)
            if time.monotonic() > deadline:
                raise EtcdError(f"no etcd member answered {path} within {self.timeout_s:g}s ({last[:200]})")
            time.sleep(RETRY_S)

    def _login(self) -> str:
        """Log in as ``user`` on the connection in use: the token etcd gives (EtcdError: refused, one line)."""
        try:
            with open(self._password_file) as f:
                password = f.read().strip()
        except OSError as exc:
            raise EtcdError(f"etcd user {self.user!r}: its password file {self._password_file!r} cannot be read "
                            f"({exc.strerror})") from exc
        self._conn.request("POST", "/v3/auth/authenticate", json.dumps({"name": self.user, "password": password}),
                           {"Content-Type": "application/json"})
        reply = self._conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise EtcdError(f"etcd refused the login of user {self.user!r}: {reply.status} {data[:160]!r}")
        return json.loads(data)["token"]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---------------------------------------------------------------- the Store interface
    def _k(self, key: str) -> str:
        return _b64(self.prefix + key.encode())

    def _fenced(self) -> List[dict]:
        if self.fence is None:
            return []
        key, value = self.fence
        return [{"key": self._k(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value.encode())}]

    def _txn(self, compare: List[dict], success: List[dict], failure: List[dict] = (), deposed_ok=False) -> dict:
        """A transaction with the fence's compare too. Deposed when the fence made it fail, unless ``deposed_ok``
        (then the caller reads ``got["deposed"]``)."""
        fence = self._fenced()
        extra = [{"requestRange": {"key": fence[0]["key"]}}] if fence else []
        got = self.post("/v3/kv/txn", {"compare": compare + fence, "success": success,
                                       "failure": list(failure) + extra})
        got["deposed"] = False
        if fence and not got.get("succeeded"):
            kvs = got["responses"][-1]["response_range"].get("kvs")
            held = base64.b64decode(kvs[0].get("value", "")) if kvs else b""
            got["deposed"] = held != self.fence[1].encode()
            if got["deposed"] and not deposed_ok:
                raise Deposed(f"the leader key names {held[:80]!r}, not {self.fence[1]!r}")
        return got

    def _range(self, key: str) -> Optional[bytes]:
        kvs = self.post("/v3/kv/range", {"key": self._k(key)}).get("kvs")
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def set(self, key, value):
        put = {"requestPut": {"key": self._k(key), "value": _b64(_bytes(value))}}
        if self.fence is None:
            self.post("/v3/kv/put", put["requestPut"])
        else:
            self._txn([], [put])

    def get(self, key):
        self.wait([key])
        return self._range(key)

    def check(self, keys):
        return all(self._range(k) is not None for k in keys)

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout.total_seconds())
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise self.Timeout(f"wait timeout after {self.timeout_s:g}s, keys: {keys}")
            time.sleep(POLL_S)

    def compare_set(self, key, expected, desired):
        k, expected, desired = self._k(key), _bytes(expected), _bytes(desired)
        compare = ({"key": k, "target": "VERSION", "result": "EQUAL", "version": "0"} if expected == b"" else
                   {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)})
        got = self._txn([compare], [{"requestPut": {"key": k, "value": _b64(desired)}}],
                        [{"requestRange": {"key": k}}], deposed_ok=True)
        kvs = [] if got.get("succeeded") else got["responses"][0]["response_range"].get("kvs")
        current = base64.b64decode(kvs[0].get("value", "")) if kvs else None
        if got["deposed"] and current == (None if expected == b"" else expected):
            raise Deposed(f"compare_set({key!r}) would have written, but this client's leadership ended")
        if got.get("succeeded"):
            return desired
        return expected if current is None else current

    def add(self, key, amount):
        # Optimistic: read, then write if unchanged since (the key's mod revision). A reply lost after the write
        # landed would add twice when asked again: a counter here only ever needs to grow.
        k = self._k(key)
        while True:
            kvs = self.post("/v3/kv/range", {"key": k}).get("kvs")
            value = int(base64.b64decode(kvs[0]["value"])) if kvs else 0
            rev = kvs[0]["mod_revision"] if kvs else "0"
            got = self._txn([{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": rev}],
                            [{"requestPut": {"key": k, "value": _b64(str(value + amount).encode())}}])
            if got.get("succeeded"):
                return value + amount

    def delete_key(self, key):
        got = self._txn([], [{"requestDeleteRange": {"key": self._k(key)}}])
        return int(got["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def _every_key(self, **options) -> dict:
        return self.post("/v3/kv/range", {"key": _b64(self.prefix), "range_end": _b64(range_end(self.prefix)),
                                          **options})

    def num_keys(self):
        return int(self._every_key(count_only=True).get("count", 0))

    def list_keys(self) -> List[str]:
        kvs = self._every_key(keys_only=True).get("kvs", [])
        return [base64.b64decode(kv["key"])[len(self.prefix):].decode(errors="replace") for kv in kvs]

    def wipe_except(self, keep: str) -> None:
        """Every key of the job but ``keep`` goes (a new job under a prefix an old one used; fenced: the leader's)."""
        k, end = self.prefix + keep.encode(), range_end(self.prefix)
        self._txn([], [{"requestDeleteRange": {"key": _b64(self.prefix), "range_end": _b64(k)}},
                       {"requestDeleteRange": {"key": _b64(k + b"\0"), "range_end": _b64(end)}}])

    # ---------------------------------------------------------------- leases (agent/leadership.py)
    def grant(self, ttl_s: int) -> str:
        got = self.post("/v3/lease/grant", {"TTL": int(ttl_s)})
        if "ID" not in got:
            raise EtcdError(f"etcd granted no lease: {json.dumps(got)[:200]}")
        return str(int(got["ID"]))

    def entry(self, key: str) -> Optional[Tuple[bytes, str]]:
        """The value at ``key`` and the lease that holds it ("0": none); None when absent."""
        kvs = self.post("/v3/kv/range", {"key": self._k(key)}).get("kvs")
        return (base64.b64decode(kvs[0].get("value", "")), str(int(kvs[0].get("lease", 0)))) if kvs else None

    def keepalive(self, lease: str) -> int:
        """The lease's seconds left after this renewal; 0 once it expired."""
        got = self.post("/v3/lease/keepalive", {"ID": lease})
        return int(got.get("result", got).get("TTL", 0))

    def revoke(self, lease: str) -> None:
        self.post("/v3/lease/revoke", {"ID": lease})

    def claim(self, key: str, value: str, lease: str, replacing: Optional[bytes] = None) -> bool:
        """Put ``value`` at ``key`` bound to ``lease`` unless the key exists: True if we did (a campaign).
        ``replacing``: a value the caller refuses (no leader's: forged, or not held by its lease): put over it if
        the key still holds exactly that, so that of several claimants over one such value only the first wins."""
        k = self._k(key)
        compare = ({"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"} if replacing is None
                   else {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(replacing)})
        got = self.post("/v3/kv/txn", {"compare": [compare],
                                       "success": [{"requestPut": {"key": k, "value": _b64(value.encode()),
                                                                   "lease": lease}}]})
        return bool(got.get("succeeded"))
