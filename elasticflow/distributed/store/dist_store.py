"""A worker's client of the job's store: the same client as the agent's, made a ``torch.distributed.Store``.

gloo's rendezvous goes through the store (``PrefixStore`` over it, comm/comm.py), so a worker's client must be a
``torch.distributed.Store``; the agent's side needs none, and importing torch there was most of every job's agent's
CPU (docs/benchmarks.md, Elasticity). So the clients (server.py, etcd.py) are plain classes, and each has a
twin here that adds ``torch.distributed.Store`` as a base: the same code, raising torch's errors (each also the
plain error it stands for, base.py), with its timeout kept on torch's side too. Only a worker imports this module
(``stores.connect``), where torch is loaded anyway.
"""
from __future__ import annotations

import torch.distributed as dist

from . import etcd, server
from .base import StoreLost, StoreTimeout, WrongToken


class DistStoreTimeout(StoreTimeout, dist.DistStoreError):
    """``get``/``wait`` timed out: TCPStore's error, and base.py's."""


class DistStoreLost(StoreLost, dist.DistNetworkError):
    """The store does not answer or closed the connection: the workers' agent-lost path."""


class DistWrongToken(WrongToken, dist.DistNetworkError):
    """A token store refused our token (or could not prove its own)."""


class _Twin:
    """What makes a plain client a ``torch.distributed.Store``: torch's errors, and its timeout on torch's side.

    Placed first in a twin's bases, with ``torch.distributed.Store`` last: the plain client's ``super().__init__()``
    then reaches torch's ``__init__``, as pybind requires.
    """

    Timeout, Lost, Refused = DistStoreTimeout, DistStoreLost, DistWrongToken

    def set_timeout(self, timeout) -> None:
        super().set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)  # the plain clients' set_timeout does not reach torch's


class StoreClient(_Twin, server.StoreClient, dist.Store):
    """``server.StoreClient`` as a ``torch.distributed.Store``.

    Note: keep a reference to it while a ``PrefixStore`` over it is in use: torch's trampoline finds the Python
    methods through the Python object, and a ``PrefixStore`` alone does not keep that alive ("INTERNAL ASSERT
    FAILED ... Not implemented" from gloo's rendezvous).
    """


class EtcdStore(_Twin, etcd.EtcdStore, dist.Store):
    """``etcd.EtcdStore`` as a ``torch.distributed.Store``."""
