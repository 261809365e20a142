"""Where a store's server listens: a socket bound to one host only (a TCPStore alone binds every interface)."""
from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (0: any free port), for a store's server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def listening_store(host: str, timeout_s: float, port: int = 0) -> "tuple[TCPStore, socket.socket]":
    """A TCPStore listening on ``host`` only (TCPStore alone would listen on every interface)."""
    from torch.distributed import TCPStore  # here: only launcher.store=tcp's agent imports torch for its store

    sock = listening_socket(host, port)
    store = TCPStore(host, sock.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=sock.fileno())
    return store, sock
