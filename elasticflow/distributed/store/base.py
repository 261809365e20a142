"""What every client of the job's store has, without torch: TCPStore's calls, its timeout and its errors.

The agent, its node agents and ``elasticflow status`` and ``scale`` use the clients as they are, so none of them
imports torch (most of an agent's CPU: docs/benchmarks.md, Elasticity). A worker connects through dist_store.py,
which makes the same client a ``torch.distributed.Store`` (gloo's rendezvous goes through it) raising torch's
errors, each of which is also the error named here: code that catches these catches both.
"""
from __future__ import annotations

import datetime


class StoreError(RuntimeError):
    """A call to the job's store failed (RuntimeError, as TCPStore's errors are)."""


class StoreTimeout(StoreError):
    """``get`` or ``wait`` ran past its timeout: the key was never set (TCPStore's ``DistStoreError``)."""


class StoreLost(StoreError):
    """The store does not answer, closed the connection, or refused it (TCPStore's ``DistNetworkError``)."""


class WrongToken(StoreLost):
    """A token store hung up on our handshake, or could not prove the token itself: not the job's token, or not
    the job's store. Not retried: it will not change."""


class Store:
    """The base of the job's store clients: the timeout ``get`` and ``wait`` wait, and which errors they raise.

    A subclass raises ``self.Timeout``, ``self.Lost`` and ``self.Refused``, never the classes by name, so that its
    ``torch.distributed.Store`` twin (dist_store.py) raises torch's errors from the same code.
    """

    Timeout, Lost, Refused = StoreTimeout, StoreLost, WrongToken

    def __init__(self):
        super().__init__()  # the twin's torch.distributed.Store.__init__ (next in its MRO); object's here
        self._timeout = datetime.timedelta(seconds=300)  # TCPStore's default

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout
