"""How the job's store and its clients talk (server.py): frames, the token handshake, and each frame's MAC.

A frame is a 4-byte length and a list of fields, each a 4-byte length and its bytes. A request is ``[op, args...]``;
a reply ``[b"ok", values...]`` or ``[b"timeout" | b"error", message]``.

On a token connection (across hosts), each side first proves the job token (``handshake``), and from then on every
frame carries a MAC under a key of that connection alone, with a count of the frames sent in that direction. So a
process on the network path cannot alter, inject, replay, reorder or reflect a frame of a proven connection: the
receiver hangs up at the first frame that fails (the client as ``DistNetworkError``, the agent-lost path's error).
What this does not give is secrecy: frames travel in clear (nothing in the store is a secret: docs/security.md).
A Unix socket (one host) has no handshake and no MAC: only the owner's processes open it.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from typing import List, Optional

MAX_FRAME = 64 << 20      # a bound against a bug, not a stranger (no stranger gets past the door)
HELLO = b"EFSTORE1"       # the server's first bytes on a token connection, then its nonce
BUSY = b"EFBUSY01"        # ... instead, when too many connections are still in their handshake: try again
NONCE = 16
TAG = 16                  # a frame's MAC (BLAKE2b, 128 bits)
_LEN = struct.Struct("!I")
_COUNT = struct.Struct("!Q")


class Busy(OSError):
    """The server has too many connections in their handshake (a flood, or a crowd of joiners): retry."""


def key_of(token: str) -> bytes:
    """The handshake's key: derived from the token, apart from the records' sealing key (_util/sealing.py)."""
    return hashlib.sha256(b"elasticflow store connection\0" + token.encode()).digest()


def _mac(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, side + server_nonce + client_nonce, hashlib.sha256).digest()


def handshake(sock: socket.socket, key: bytes, server: bool) -> Optional[bytes]:
    """Both sides prove the token; the connection's own key if they did, None if the other side did not.

    The server sends a nonce, the client its nonce and a MAC over both, the server its own MAC. Fresh nonces
    on each side: a recorded handshake replays into nothing, and each connection's frame key is new.
    A server that answers ``BUSY`` raises ``Busy``."""
    if server:
        nonce = secrets.token_bytes(NONCE)
        sock.sendall(HELLO + nonce)
        answer = _recv_exact(sock, NONCE + 32)
        theirs, mac = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(mac, _mac(key, b"client", nonce, theirs)):
            return None
        sock.sendall(_mac(key, b"server", nonce, theirs))
        return _mac(key, b"frames", nonce, theirs)
    hello = _recv_exact(sock, len(HELLO) + NONCE)
    if hello.startswith(BUSY):
        raise Busy("the store is busy with other connections' handshakes")
    if not hello.startswith(HELLO):
        return None
    theirs, nonce = hello[len(HELLO):], secrets.token_bytes(NONCE)
    sock.sendall(nonce + _mac(key, b"client", theirs, nonce))
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(key, b"server", theirs, nonce)):
        return None
    return _mac(key, b"frames", theirs, nonce)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Frames:
    """One connection's frames, each with its MAC and count when ``key`` is given (a proven token connection).

    ``server``: which side this is; a frame's MAC covers its direction, so one the server sent cannot be
    reflected back to it as the client's."""

    def __init__(self, sock: socket.socket, key: Optional[bytes] = None, server: bool = False):
        self.sock, self._key = sock, key
        self._sent = self._received = 0
        if key is not None:  # keyed once; each frame's MAC starts from a copy (half the cost of a new one)
            sides = [hashlib.blake2b(key=key, person=side, digest_size=TAG)
                     for side in (b"ef-store-server", b"ef-store-client")]
            self._mine, self._theirs = sides if server else sides[::-1]

    @staticmethod
    def _tag(side, count: int, body: bytes) -> bytes:
        mac = side.copy()
        mac.update(_COUNT.pack(count))
        mac.update(body)
        return mac.digest()

    def send(self, fields: List[bytes]) -> None:
        body = b"".join(_LEN.pack(len(f)) + f for f in fields)
        if self._key is not None:
            body += self._tag(self._mine, self._sent, body)
            self._sent += 1
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def recv(self) -> List[bytes]:
        """The next frame's fields. ``ConnectionError`` if the connection closed, or the frame is too large,
        malformed, or (on a token connection) not MACed by the other side under this connection's key."""
        (size,) = _LEN.unpack(_recv_exact(self.sock, 4))
        if size > MAX_FRAME:
            raise ConnectionError(f"a frame of {size} bytes")
        body = _recv_exact(self.sock, size)
        if self._key is not None:
            body, tag = body[:-TAG], body[-TAG:]
            if size < TAG or not hmac.compare_digest(tag, self._tag(self._theirs, self._received, body)):
                raise ConnectionError("a frame that does not carry this connection's MAC (altered, replayed or "
                                      "injected on the way)")
            self._received += 1
        fields, at = [], 0
        while at < len(body):
            (n,) = _LEN.unpack_from(body, at)
            if at + 4 + n > len(body):
                raise ConnectionError("a malformed frame")
            fields.append(body[at + 4:at + 4 + n])
            at += 4 + n
        return fields
