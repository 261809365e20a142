"""The job's store: which kind serves it (``launcher.store``), and connecting to one by its address.

- ``unix:<path>`` (``private``): a Unix socket only the owner's processes can open (server.py).
  ``launcher=local``'s by default.
- ``token:<host>:<port>`` (``token``): a TCP port that serves only connections proving the job token
  (server.py). Across hosts (``launcher=nodes``, ``slurm``, ``kubernetes``) by default.
- ``etcd:<endpoints, prefix, TLS files>`` (``etcd``): the job's keys in an etcd cluster (etcd.py), which no
  host of the job serves: losing one loses no record (launchers/failover.py).
- ``<host>:<port>`` (``tcp``): a TCPStore. Anyone who reaches the port may connect; every record is sealed, the
  connection is not (docs/security.md). Only where asked for: ``launcher.store=tcp``.

A worker connects with ``connect``: a ``torch.distributed.Store``, for gloo's rendezvous (dist_store.py). The
agent's side (the agent, node agents, ``elasticflow status`` and ``scale``) uses ``client`` and ``serve``, which
import no torch but for ``tcp``'s TCPStore.
"""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from . import etcd, server
from .base import Store, StoreError, StoreLost, StoreTimeout, WrongToken  # noqa: F401 - the errors, here too
from .listen import listening_store

if TYPE_CHECKING:
    import torch.distributed as dist

PRIVATE, TOKEN, TCP, ETCD = "private", "token", "tcp", "etcd"


def connect(address: str, timeout_s: float, token: Optional[str] = None) -> "dist.Store":
    """A worker's client of the job's store at ``address``: a ``torch.distributed.Store`` (imports torch).

    ``token``: the job's, which a ``token:`` store needs. Its errors are torch's, each also base.py's.
    """
    from . import dist_store  # torch: loaded in a worker anyway

    return _open(address, timeout_s, token, dist_store.StoreClient, dist_store.EtcdStore)


def client(address: str, timeout_s: float, token: Optional[str] = None) -> Store:
    """A client of the job's store at ``address`` that imports no torch (but for a ``tcp`` store's TCPStore):
    the agent's side, node agents, ``elasticflow status``. Not for gloo: that takes ``connect``'s."""
    return _open(address, timeout_s, token, server.StoreClient, etcd.EtcdStore)


def _open(address: str, timeout_s: float, token: Optional[str], store_client: type, etcd_client: type) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if address.startswith(etcd.SCHEME):  # the token seals every record; the connection is mutual TLS
        return etcd_client(address, timeout)
    if address.startswith((server.SCHEME, server.TOKEN_SCHEME)):
        return store_client(address, timeout, token)
    from torch.distributed import TCPStore  # launcher.store=tcp: torch's own store, torch's own client

    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timeout=timeout)


def address_of(kind: str, endpoint: str) -> str:
    """The address of the store of kind ``kind`` at ``endpoint`` (HOST:PORT, or already an address)."""
    if kind == TOKEN and not endpoint.startswith(server.TOKEN_SCHEME):
        return server.TOKEN_SCHEME + endpoint
    return endpoint


def host_of(address: str) -> str:
    """The host a store's address names: where gloo looks for the route toward the agent."""
    if address.startswith(server.SCHEME):
        return "127.0.0.1"
    if address.startswith(etcd.SCHEME):
        return etcd.first_endpoint(address).hostname
    if address.startswith(server.TOKEN_SCHEME):
        address = address[len(server.TOKEN_SCHEME):]
    return address.rsplit(":", 1)[0]


def port_of(address: str) -> Optional[int]:
    """The TCP port a store's address names; None for a Unix socket's."""
    if address.startswith(server.SCHEME):
        return None
    if address.startswith(etcd.SCHEME):  # the members' client port (every member's, as is usual)
        return etcd.first_endpoint(address).port or 2379
    return int(address.rsplit(":", 1)[1])


def serve(kind: str, host: str, port: int, state_dir: Path, timeout_s: float, token: str) \
        -> "Tuple[Any, str, Callable[[], None]]":
    """Start the job's store in this (the agent's) process: its client here, its address, and how to close it.

    The client imports no torch (``server.InProcessStore``), but for ``tcp``'s TCPStore.

    Closing ends every client's connection: each worker's next store call fails (the agent-lost path).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if kind in (PRIVATE, TOKEN):
        serving = (server.StoreServer.private(server.socket_path(state_dir)) if kind == PRIVATE
                   else server.StoreServer.token(host, port, token))
        return server.InProcessStore(serving, timeout), serving.address, serving.close
    store, listener = listening_store(host, timeout_s, port)
    return store, f"{host}:{store.port}", listener.close
