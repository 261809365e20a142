"""This process's TCP connections, known by their sockets' inodes: to cut a collective's links at once.

A gloo collective waiting on a silent peer (its host powered off or cut off: no FIN or RST ever comes) has no
way out but its timeout, and ``ProcessGroupGloo.abort()`` does not wake it (measured, torch 2.13). Shutting down
our end of its connections does: the pending call fails at once ("Connection closed by peer"), dropping the
group no longer blocks, and nothing a healed peer sends later lands in our memory (its packets meet a closed
socket). Which connections are a group's: those its construction opened (``opened_since``), less listeners
and those to the store.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, Iterable, Optional, Set

_TCP = (socket.AF_INET, socket.AF_INET6)


def sockets() -> Dict[int, int]:
    """inode -> file descriptor, for every socket this process holds (read from /proc/self/fd)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing to cut, collectives end by their timeout as before
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, too)
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(fd)
    return out


def inode_of(sock: socket.socket) -> int:
    """The inode of a socket object's socket (as ``sockets()`` keys it)."""
    return os.fstat(sock.fileno()).st_ino


def _open(fd: int, inode: int) -> Optional[socket.socket]:
    """A socket object on a duplicate of ``fd``, if it still is the socket ``inode`` (a descriptor number may
    have been reused since); closing it closes only the duplicate."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def opened_since(before: Dict[int, int], not_to_port: Optional[int] = None) -> Set[int]:
    """The TCP connections this process opened since ``before`` (``sockets()`` then): not listeners (shutting one
    down makes gloo's accept loop abort the process), nor connections to port ``not_to_port`` (the store's)."""
    links = set()
    for inode, fd in sockets().items():
        if inode in before:
            continue
        sock = _open(fd, inode)
        if sock is None:
            continue
        with sock:
            try:
                if sock.family not in _TCP or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if not_to_port is not None and sock.getpeername()[1] == not_to_port:
                    continue
            except OSError:  # not connected (any more)
                continue
            links.add(inode)
    return links


def cut(links: Iterable[int]) -> int:
    """Shut down both directions of each connection in ``links`` still open; how many were."""
    now, done = sockets(), 0
    for inode in links:
        sock = _open(now[inode], inode) if inode in now else None
        if sock is None:
            continue
        with sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # already closed by its peer
                pass
    return done
