"""How the job's store and its clients talk (server.py): frames, the token handshake, and each frame's MAC.

A frame is a 4-byte length and a list of fields, each a 4-byte length and its bytes. A request is ``[op, args...]``;
a reply ``[b"ok", values...]`` or ``[b"timeout" | b"error", message]``.

On a token connection (across hosts), each side first proves the job token (``server_handshake``,
``client_handshake``), all of it within a deadline from accept, and from then on every
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
import time
from typing import List, Optional

MAX_FRAME = 64 << 20      # a bound against a bug, not a stranger (no stranger gets past the door)
OPEN = b"EFOPEN02"        # a client's first bytes on a token connection, then its nonce and a MAC over it
HELLO = b"EFSTORE2"       # the server's first bytes, once the client's opening is read, then its nonce
BUSY = b"EFBUSY02"        # ... instead, when too many connections are still in their handshake: try again
LATE = b"EFLATE02"        # ... or in place of the server's proof: the handshake ran past its deadline, try again
NONCE = 16
PROOF = 32                # an HMAC-SHA256
OPENING = len(OPEN) + NONCE + PROOF
TAG = 16                  # a frame's MAC (BLAKE2b, 128 bits)
_LEN = struct.Struct("!I")
_COUNT = struct.Struct("!Q")


class Busy(OSError):
    """The server has too many connections in their handshake (a flood, or a crowd of joiners), or ours ran
    past its deadline: retry."""


class WrongByte(ConnectionError):
    """The other side sent a byte no holder of the token sends: it is hung up on there and then."""


def key_of(token: str) -> bytes:
    """The handshake's key: derived from the token, apart from the records' sealing key (_util/sealing.py)."""
    return hashlib.sha256(b"elasticflow store connection\0" + token.encode()).digest()


def _mac(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, side + server_nonce + client_nonce, hashlib.sha256).digest()


def opening(key: bytes) -> "tuple[bytes, bytes]":
    """A client's first bytes (``OPEN``, a fresh nonce, a MAC over it) and that nonce."""
    nonce = secrets.token_bytes(NONCE)
    return OPEN + nonce + _mac(key, b"open", b"", nonce), nonce


def opening_check(key: bytes, got: bytes) -> Optional[bool]:
    """What the first ``len(got)`` bytes of a client's opening say: True, a whole and valid opening; False, a
    wrong byte (hang up now); None, right so far.

    The MAC is checked byte by byte as it comes. That tells a stranger which byte was wrong, and it learns
    nothing from it: the connection ends there, and the next one's nonce asks for another MAC."""
    head = got[:len(OPEN)]
    if head != OPEN[:len(head)] or len(got) > OPENING:
        return False
    if len(got) <= len(OPEN) + NONCE:
        return None
    want = _mac(key, b"open", b"", got[len(OPEN):len(OPEN) + NONCE])
    mac = got[len(OPEN) + NONCE:]
    if not hmac.compare_digest(mac, want[:len(mac)]):
        return False
    return True if len(got) == OPENING else None


def server_handshake(sock: socket.socket, key: bytes, deadline: float, head: bytes = b"") -> bytes:
    """The server's side of the handshake, all of it by ``deadline`` (``time.monotonic()``): the connection's
    own key. ``WrongByte`` at the client's first byte that no holder of the token sends (hang up at once);
    past the deadline ``socket.timeout``, after telling the client to try again (``BUSY`` or ``LATE``), since a
    slow client is not a wrong token. ``head``: the opening's bytes already read (at accept).

    The client opens with a nonce and a MAC over it (``opening``): proof enough to admit it ahead of strangers
    (server.py), not to serve it. The server then sends its own nonce, the client a MAC over both, the server
    its MAC over both. Fresh nonces on each side: a recorded handshake replays into nothing, and each
    connection's frame key is new."""
    def late(marker: bytes, size: int):  # as many bytes as the client waits for there
        try:
            sock.setblocking(False)
            sock.send(marker + bytes(size - len(marker)))
        except OSError:
            pass
        raise socket.timeout("the handshake ran past its deadline")

    try:
        got = read_until(sock, OPENING, deadline, lambda b: opening_check(key, b), head)
    except socket.timeout:
        late(BUSY, len(HELLO) + NONCE)
    theirs, nonce = got[len(OPEN):len(OPEN) + NONCE], secrets.token_bytes(NONCE)
    sock.sendall(HELLO + nonce)
    want = _mac(key, b"client", nonce, theirs)
    try:
        read_until(sock, PROOF, deadline, lambda b: None if hmac.compare_digest(b, want[:len(b)]) else False)
    except socket.timeout:
        late(LATE, PROOF)
    sock.sendall(_mac(key, b"server", nonce, theirs))
    return _mac(key, b"frames", nonce, theirs)


def client_handshake(sock: socket.socket, key: bytes, deadline: float) -> Optional[bytes]:
    """The client's side (see ``server_handshake``): the connection's own key, or None if the server did not
    prove the token. ``Busy`` if the server says to come back (``BUSY`` or ``LATE``), or the deadline passed."""
    first, nonce = opening(key)
    sock.sendall(first)
    try:
        hello = read_until(sock, len(HELLO) + NONCE, deadline)
        if hello.startswith(BUSY):
            raise Busy("the store is busy with other connections' handshakes")
        if not hello.startswith(HELLO):
            return None
        theirs = hello[len(HELLO):]
        sock.sendall(_mac(key, b"client", theirs, nonce))
        proof = read_until(sock, PROOF, deadline)
    except socket.timeout:
        raise Busy("the store did not finish the handshake in time") from None
    if proof.startswith(LATE):
        raise Busy("the handshake ran past the store's deadline")
    if not hmac.compare_digest(proof, _mac(key, b"server", theirs, nonce)):
        return None
    return _mac(key, b"frames", theirs, nonce)


def read_until(sock: socket.socket, n: int, deadline: float, check=None, head: bytes = b"") -> bytes:
    """``n`` bytes (``head`` already read), all of them by ``deadline``: ``socket.timeout`` past it, however
    the bytes trickle in (a limit per ``recv`` would let one byte every few seconds hold the connection).
    ``check(bytes so far)`` after each read: False is a wrong byte (``WrongByte``)."""
    got = bytearray(head)
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the handshake's deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError("closed")
        got += chunk
        if check is not None and check(bytes(got)) is False:
            raise WrongByte("a byte no holder of the token sends")
    return bytes(got)


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
