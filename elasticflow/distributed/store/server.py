"""The job's store as the agent serves it: on one host a Unix socket only the owner opens (``private``), across
hosts a TCP port that serves only connections proving the job token (``token``). stores.py picks one.

Why not TCPStore: it serves whoever connects. On one host, every local user can reach a loopback port (and find
its number in ``/proc/net/tcp``); across hosts, everyone on the network. So:
- ``private``: a Unix socket in ``RUN_DIR/.elasticflow/`` (mode 0700) can be opened only by the owner; the server
  also reads each connection's peer credentials (``SO_PEERCRED``) and hangs up on any other user, so a loosened
  directory mode does not open the door either.
- ``token``: before anything else on a connection, each side proves it holds the job token (``wire``'s handshake:
  HMACs over two fresh nonces, one from each side), all of it within HANDSHAKE_S of accept. A stranger is hung
  up on before a byte of a request is read, and a worker never talks to an impostor. Then every frame carries a
  MAC under that connection's own key, so nothing on the network path alters or injects one. Nothing is
  encrypted (docs/security.md says what that leaves). wire.py is the wire: frames, the handshake, the MACs.
  The door admits the job's own connections ahead of strangers' (``_at_the_door``, docs/security.md).

The server runs in the agent's process (a thread per connection), so it dies with the agent, as TCPStore's
would: the workers see the connection close and take the agent-lost path. The client's semantics are TCPStore's:
``get`` and ``wait`` block until the key exists or the timeout passes (``StoreTimeout``), ``add`` counts in decimal
text, ``compare_set`` answers as TCPStore does, a lost or refused connection is ``StoreLost``. It imports no
torch (the agent's side uses it as it is); a worker's is its ``torch.distributed.Store`` twin (dist_store.py), so
gloo rendezvouses through it (``PrefixStore`` and all) and it raises torch's errors.
"""
from __future__ import annotations

import datetime
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Dict, List, Optional

from .base import Store, WrongToken  # noqa: F401 - WrongToken: callers find it here too
from .listen import listening_socket
from .wire import BUSY, NONCE, OPEN, OPENING, Busy, Frames, client_handshake, key_of, opening_check, \
    server_handshake

SCHEME = "unix:"          # a private store's address: unix:<path>
TOKEN_SCHEME = "token:"   # a token store's: token:<host>:<port>
HANDSHAKE_S = 3.0         # the whole handshake, from accept: a connection that has not proved the token by then
                          # is hung up on, however its bytes trickle in
# The door has two ways in. A client's first bytes carry a MAC over its nonce (wire.opening): one whose opening
# is whole and valid at accept has shown it holds the token, and goes on to the rest of its handshake without
# taking a place. Any other connection (a stranger's; ours, if its opening came in pieces) takes one of a few
# places, from one peer address and in all; more are told BUSY and close (the client retries until its timeout).
# So a stranger who fills its address's places, even from the job's own hosts, keeps no worker out; and it holds
# a place until its first wrong byte or HANDSHAKE_S, whichever comes first.
MAX_UNPROVEN_PER_PEER = 16
MAX_UNPROVEN = 256
SEEN_OPENINGS = 1 << 16   # the nonces of the newest openings let in: a recorded one, replayed, waits for a place
_MAX_PATH = 100           # sun_path holds 108 bytes; a deeper run directory gets a private one under /tmp


def socket_path(state_dir: Path) -> Path:
    """Where the store's socket goes: ``state_dir/store.sock``, or, if that path is too long for a Unix
    socket, ``store.sock`` in a new 0700 directory under the temporary directory."""
    path = Path(state_dir) / "store.sock"
    if len(os.fsencode(str(path))) <= _MAX_PATH:
        return path
    return Path(tempfile.mkdtemp(prefix="elasticflow-")) / "store.sock"


def _private_dir(path: Path) -> None:
    """The socket's directory is made the owner's alone (0700); one of another user is refused."""
    info = os.lstat(path.parent)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path.parent} is not a directory of this user: the job's store cannot be made "
                              "private there (run the job from a run directory of your own)")
    os.chmod(path.parent, 0o700)

# ----------------------------------------------------------------------------------------------- server
class StoreServer:
    """The store's keys, served to this user's processes on a Unix socket, or to the job's on a TCP port.

    Use ``StoreServer.private(path)`` or ``StoreServer.token(host, port, token)``.
    """

    def __init__(self, listener: socket.socket, address: str, token: Optional[str] = None,
                 path: Optional[Path] = None):
        self.path, self._address, self._key = path, address, (key_of(token) if token is not None else None)
        self._data: Dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._conns: List[socket.socket] = []
        self._closed = False
        self._listener = listener
        self._unproven: Dict[str, int] = {}  # peer address -> its connections still in their handshake
        self._door = threading.Lock()
        self._seen: "deque[bytes]" = deque()  # the newest openings' nonces, oldest first (and as a set)
        self._seen_set = set()
        self.refused_peers = 0  # connections hung up on: another user's, or without the token
        self.busy_peers = 0     # connections told to come back: too many were in their handshake
        threading.Thread(target=self._accept, name="elasticflow-store", daemon=True).start()

    @classmethod
    def private(cls, path: Path) -> "StoreServer":
        """On a Unix socket at ``path`` (its directory must be this user's; made 0700; see ``socket_path``)."""
        path = Path(path)
        _private_dir(path)
        path.unlink(missing_ok=True)  # a stale socket of an earlier run of this directory
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file 0600 from the start, not after a chmod
        try:
            listener.bind(str(path))
        finally:
            os.umask(old)
        listener.listen(256)
        return cls(listener, SCHEME + str(path), path=path)

    @classmethod
    def token(cls, host: str, port: int, token: str) -> "StoreServer":
        """On TCP ``host:port`` (0: any free port), serving only connections that prove ``token``."""
        listener = listening_socket(host, port)
        if hasattr(socket, "TCP_DEFER_ACCEPT"):  # accept once the client's first bytes are in (Linux): its
            # opening is then read at accept, so a worker is let in at once, whoever holds the places
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, int(HANDSHAKE_S))
        return cls(listener, f"{TOKEN_SCHEME}{host}:{listener.getsockname()[1]}", token=token)

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        """Stop serving: every client's next call fails (the workers' agent-lost path)."""
        self._closed = True
        for s in [self._listener, *self._conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        with self._changed:
            self._changed.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            try:
                self._at_the_door(conn, peer)
            except OSError:  # it reset already: the door goes on
                conn.close()

    def _at_the_door(self, conn: socket.socket, peer) -> None:
        """Serve ``conn`` (on a thread of its own), or hang up on it now. Never waits for the peer."""
        accepted, head, place = time.monotonic(), b"", False
        if self._key is None:
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                self._refuse(conn)
                return
        else:
            head = self._first_bytes(conn)
            verdict = None if head is None else opening_check(self._key, head)
            if head is None or verdict is False:  # closed already, or a wrong byte: no place, no thread
                self._refuse(conn)
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            place = not (verdict and self._fresh(head))
            if place and not self._admit(peer[0]):
                self._busy(conn)
                return
        threading.Thread(target=self._serve, args=(conn, peer, accepted, head, place),
                         name="elasticflow-store-conn", daemon=True).start()

    @staticmethod
    def _first_bytes(conn: socket.socket) -> Optional[bytes]:
        """What the client sent before accept (up to its opening), without waiting; None if it closed."""
        try:
            head = conn.recv(OPENING, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        return head or None

    def _fresh(self, head: bytes) -> bool:
        """Whether this opening's nonce is new (recorded and replayed, it gets no way around the places)."""
        nonce = head[len(OPEN):len(OPEN) + NONCE]
        with self._door:
            if nonce in self._seen_set:
                return False
            self._seen.append(nonce)
            self._seen_set.add(nonce)
            if len(self._seen) > SEEN_OPENINGS:
                self._seen_set.discard(self._seen.popleft())
            return True

    def _admit(self, peer: str) -> bool:
        """A place at the door (a connection in its handshake) for ``peer``, if it and the door have one."""
        with self._door:
            if self._unproven.get(peer, 0) >= MAX_UNPROVEN_PER_PEER or sum(self._unproven.values()) >= MAX_UNPROVEN:
                return False
            self._unproven[peer] = self._unproven.get(peer, 0) + 1
            return True

    def places_held(self) -> int:
        """How many connections hold a place at the door now (in their handshake, without a valid opening)."""
        with self._door:
            return sum(self._unproven.values())

    def _proven_or_not(self, peer: str) -> None:
        with self._door:
            self._unproven[peer] -= 1
            if not self._unproven[peer]:
                del self._unproven[peer]

    def _refuse(self, conn: socket.socket) -> None:
        self.refused_peers += 1
        conn.close()

    def _busy(self, conn: socket.socket) -> None:
        self.busy_peers += 1
        try:
            conn.setblocking(False)  # 24 bytes into an empty socket buffer: never blocks the door
            conn.recv(OPENING)       # and what came, read: a close with bytes unread resets, which may lose BUSY
        except OSError:
            pass
        try:
            conn.send(BUSY + bytes(16))
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket, peer, accepted: float, head: bytes, place: bool) -> None:
        try:
            frames = Frames(conn)
            if self._key is not None:
                try:
                    session = server_handshake(conn, self._key, accepted + HANDSHAKE_S, head)
                except (ConnectionError, OSError):
                    session = None  # it hung up, sent a wrong byte, or did not finish in time
                finally:
                    if place:
                        self._proven_or_not(peer[0])
                if session is None:
                    self.refused_peers += 1
                    return
                conn.settimeout(None)
                frames = Frames(conn, session, server=True)
            self._conns.append(conn)
            while not self._closed:
                request = frames.recv()
                frames.send(self.handle(request[0].decode(), request[1:]))
        except (ConnectionError, OSError, struct.error, UnicodeDecodeError, IndexError):
            pass
        finally:
            conn.close()
            if conn in self._conns:
                self._conns.remove(conn)

    def handle(self, op: str, args: List[bytes]) -> List[bytes]:
        """One request's reply (also the agent's own, in-process client)."""
        try:
            return [b"ok", *getattr(self, "_op_" + op)(*args)]
        except _Timeout as exc:
            return [b"timeout", str(exc).encode()]
        except (AttributeError, TypeError, ValueError, UnicodeDecodeError) as exc:
            return [b"error", f"{op}: {type(exc).__name__}: {exc}".encode()]

    def _await(self, keys: List[str], timeout_ms: bytes) -> None:
        deadline = time.monotonic() + int(timeout_ms) / 1000
        with self._changed:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    missing = [k for k in keys if k not in self._data]
                    raise _Timeout(f"wait timeout after {int(timeout_ms)} ms, keys: {missing}")
                self._changed.wait(left)

    def _op_set(self, key: bytes, value: bytes) -> List[bytes]:
        with self._changed:
            self._data[key.decode()] = value
            self._changed.notify_all()
        return []

    def _op_get(self, key: bytes, timeout_ms: bytes) -> List[bytes]:
        self._await([key.decode()], timeout_ms)
        with self._changed:
            return [self._data[key.decode()]]

    def _op_add(self, key: bytes, amount: bytes) -> List[bytes]:
        with self._changed:
            value = int(self._data.get(key.decode(), b"0")) + int(amount)
            self._data[key.decode()] = str(value).encode()
            self._changed.notify_all()
        return [str(value).encode()]

    def _op_compare_set(self, key: bytes, expected: bytes, desired: bytes) -> List[bytes]:
        k = key.decode()
        with self._changed:  # TCPStore's answers: the new value if it was set, else what is there
            current = self._data.get(k)
            if (current is None and expected == b"") or (current is not None and current == expected):
                self._data[k] = desired
                self._changed.notify_all()
                return [desired]
            return [expected if current is None else current]

    def _op_check(self, *keys: bytes) -> List[bytes]:
        with self._changed:
            return [b"1" if all(k.decode() in self._data for k in keys) else b"0"]

    def _op_wait(self, timeout_ms: bytes, *keys: bytes) -> List[bytes]:
        self._await([k.decode() for k in keys], timeout_ms)
        return []

    def _op_delete_key(self, key: bytes) -> List[bytes]:
        with self._changed:
            return [b"1" if self._data.pop(key.decode(), None) is not None else b"0"]

    def _op_num_keys(self) -> List[bytes]:
        with self._changed:
            return [str(len(self._data)).encode()]

    def _op_list_keys(self) -> List[bytes]:
        with self._changed:
            return [k.encode() for k in self._data]


class _Timeout(Exception):
    pass


# ----------------------------------------------------------------------------------------------- client
class StoreClient(Store):
    """A client of ``StoreServer``, with TCPStore's semantics (a worker's: dist_store.StoreClient).

    Args:
        address: the agent's ``StoreServer.address``: ``unix:<path>`` or ``token:<host>:<port>``.
        timeout: how long ``get`` and ``wait`` wait for a key, and the connection for the server.
        token: the job token, which a ``token:`` store's connection must prove.

    Note: one call at a time per client (a lock), as gloo and our threads share a client.
    """

    def __init__(self, address: str, timeout: datetime.timedelta, token: Optional[str] = None):
        super().__init__()
        if not address.startswith((SCHEME, TOKEN_SCHEME)):
            raise ValueError(f"not a store address: {address!r} (expected unix:<path> or token:<host>:<port>)")
        if address.startswith(TOKEN_SCHEME) and not token:
            raise ValueError(f"the store at {address} serves only connections that prove the job token: pass it")
        self.address, self._token = address, token
        self.set_timeout(timeout)
        self._lock = threading.Lock()
        self._frames = self._connect()

    def _open(self) -> Frames:
        if self.address.startswith(SCHEME):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.address[len(SCHEME):])
            except OSError:
                sock.close()
                raise
            return Frames(sock)
        host, port = self.address[len(TOKEN_SCHEME):].rsplit(":", 1)
        deadline = time.monotonic() + HANDSHAKE_S + 1  # the server's deadline passes first: it says LATE
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = client_handshake(sock, key_of(self._token), deadline)
        except Busy:
            sock.close()
            raise
        except ConnectionResetError:  # a BUSY lost to a reset (not how a wrong token is hung up on: a close)
            sock.close()
            raise Busy("the store reset the connection during the handshake") from None
        except OSError:
            sock.close()
            raise PermissionError("it hung up during the handshake: the job token is wrong") from None
        if session is None:
            sock.close()
            raise PermissionError("it did not prove the job token: not this job's store")
        sock.settimeout(None)
        return Frames(sock, session, server=False)

    def _connect(self) -> Frames:
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                return self._open()
            except PermissionError as exc:  # a refusal will not change: not retried
                wrong = self.Refused if self.address.startswith(TOKEN_SCHEME) else self.Lost
                raise wrong(f"the job's store at {self.address} refused this process: {exc}") from None
            except OSError as exc:  # not yet, or no longer, served, or busy: TCPStore too retries until its timeout
                if time.monotonic() >= deadline:
                    raise self.Lost(f"the job's store at {self.address} does not answer ({exc})") \
                        from None
            time.sleep(0.05)

    def _call(self, op: str, *args: bytes) -> List[bytes]:
        with self._lock:
            try:
                self._frames.send([op.encode(), *args])
                reply = self._frames.recv()
            except (ConnectionError, OSError, struct.error) as exc:
                raise self.Lost(f"the job's store at {self.address} closed the connection "
                                            f"({type(exc).__name__}: {exc})") from None
        return self._answer(op, reply)

    def _answer(self, op: str, reply: List[bytes]) -> List[bytes]:
        if reply[0] == b"ok":
            return reply[1:]
        if reply[0] == b"timeout":
            raise self.Timeout(reply[1].decode())
        raise RuntimeError(f"the job's store refused {op}: {reply[1].decode()}")

    def _ms(self, timeout: Optional[datetime.timedelta] = None) -> bytes:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        return str(int(seconds * 1000)).encode()

    @staticmethod
    def _bytes(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value) -> None:
        self._call("set", key.encode(), self._bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key.encode(), self._ms())[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key.encode(), str(int(amount)).encode())[0])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key.encode(), self._bytes(expected), self._bytes(desired))[0]

    def check(self, keys: List[str]) -> bool:
        return self._call("check", *[k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        self._call("wait", self._ms(timeout), *[k.encode() for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0])

    def list_keys(self) -> List[str]:
        return [k.decode() for k in self._call("list_keys")]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout_s = timeout.total_seconds()

    def clone(self) -> "StoreClient":
        """A client on a connection of its own (``protocol.draw`` draws counters on one), of this one's class."""
        return type(self)(self.address, self.timeout, self._token)

    def close(self) -> None:
        self._frames.sock.close()


class InProcessStore(StoreClient):
    """The agent's own client of its server: the same calls, without a socket (the server is in this process).

    Its ``get`` and ``wait`` would block the agent's loop; it uses neither (``untrusted.read`` never waits).
    """

    def __init__(self, server: StoreServer, timeout: datetime.timedelta):
        Store.__init__(self)
        self.address, self._server = server.address, server
        self.set_timeout(timeout)

    def _call(self, op: str, *args: bytes) -> List[bytes]:
        return self._answer(op, self._server.handle(op, list(args)))

    def clone(self) -> "InProcessStore":
        return self

    def close(self) -> None:
        self._server.close()
