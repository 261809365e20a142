"""The job's store: which kind serves it, and connecting to one by its address.

- ``unix:<path>``: the private store of one host (private_store.py). Only the owner's processes can open
  it. ``launcher=local``'s, unless ``launcher.store=tcp``.
- ``HOST:PORT``: a TCPStore. Anyone who reaches the port may connect; every record is sealed, the connection is
  not (docs/security.md). Across hosts (``launcher=nodes``, ``slurm``, ``kubernetes``), and ``launcher.store=tcp``.
"""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Callable, Tuple

import torch.distributed as dist
from torch.distributed import TCPStore

from . import private_store
from .process import listening_store

PRIVATE, TCP = "private", "tcp"


def connect(address: str, timeout_s: float) -> dist.Store:
    """A client of the job's store at ``address`` (``unix:<path>`` or ``HOST:PORT``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if address.startswith(private_store.SCHEME):
        return private_store.PrivateStore(address, timeout)
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timeout=timeout)


def host_of(address: str) -> str:
    """The host a store's address names: where gloo looks for the route toward the agent."""
    return "127.0.0.1" if address.startswith(private_store.SCHEME) else address.rsplit(":", 1)[0]


def serve(kind: str, host: str, port: int, state_dir: Path, timeout_s: float) \
        -> "Tuple[dist.Store, str, Callable[[], None]]":
    """Start the job's store in this (the agent's) process: its client here, its address, and how to close it.

    Closing ends every client's connection: each worker's next store call fails (the agent-lost path).
    """
    if kind == PRIVATE:
        server = private_store.StoreServer(private_store.socket_path(state_dir))
        return private_store.InProcessStore(server, datetime.timedelta(seconds=timeout_s)), server.address, \
            server.close
    store, listener = listening_store(host, timeout_s, port)
    return store, f"{host}:{store.port}", listener.close
