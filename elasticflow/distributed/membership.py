"""The worker's side of membership: join, notice new generations, rebuild the group.

A background thread polls ``gen/current`` on its own store connection (the store client is not
shared across threads), so the training thread reads the newest generation without a round trip
and learns within ``POLL_S`` when the agent is gone.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import List, Optional

from torch.distributed import TCPStore

from . import protocol
from .comm import Group
from .protocol import CommError

log = logging.getLogger("elasticflow")
POLL_S = 0.05


class StopRequested(Exception):
    """The agent ended the job (e.g. fewer than launcher.min_workers for elastic.wait_s)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class AgentLost(Exception):
    """The agent's store stopped answering."""


class Removed(Exception):
    """The newest generation does not include this worker."""


def _connect(address: str, timeout_s: float) -> TCPStore:
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=timeout_s))


class Membership:
    """This worker's view: generation, rank, world size and the generation's ``Group``.

    Args:
        address: the agent's store, "host:port".
        worker_id: this worker's id (stable for the life of the process).
        timeout_s: collective and rendezvous timeout (``elastic.timeout_s``).
        wait_s: how long a worker waits for the agent's next generation (``elastic.wait_s``).
    """

    def __init__(self, address: str, worker_id: int, timeout_s: float, wait_s: float, host: str = "127.0.0.1"):
        self.address, self.worker_id = address, worker_id
        self.timeout_s, self.wait_s, self.host = timeout_s, wait_s, host
        self.store = _connect(address, timeout_s)
        self.generation = -1
        self.rank, self.world = 0, 1
        self.members: List[int] = []
        self.group: Optional[Group] = None
        self.latest_generation = 0
        self.agent_lost = False
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="elasticflow-membership", daemon=True)

    # -- background
    def _poll(self) -> None:
        try:
            store = _connect(self.address, self.timeout_s)
            while not self._stop.wait(POLL_S):
                self.latest_generation = int(store.get("gen/current"))
        except Exception:  # the agent's store is gone
            if not self._stop.is_set():
                self.agent_lost = True

    def close(self) -> None:
        self._stop.set()
        if self.group is not None:
            self.group.close()

    # -- joining and rebuilding
    def join(self) -> None:
        """Register with the agent and enter the first generation that lists this worker."""
        self.store.set(f"worker/{self.worker_id}/pid", str(os.getpid()))
        self._poller.start()
        self.rebuild(after=-1)

    def rebuild(self, after: int) -> None:
        """Drop the current group; build the group of the first generation newer than ``after``.

        Raises StopRequested, Removed or AgentLost; retries when a member vanishes mid-build.
        """
        if self.group is not None:
            self.group.close()
            self.group = None
        while True:
            g, info = self._next_generation(after)
            members = info["members"]
            if self.worker_id not in members:
                raise Removed(f"generation {g} does not include worker {self.worker_id}")
            self.generation, self.members = g, members
            self.rank, self.world = members.index(self.worker_id), len(members)
            try:
                self.group = Group(self.store, g, self.rank, self.world, self.timeout_s, self.host)
            except CommError as exc:
                log.warning("worker %d: %s; waiting for the next generation", self.worker_id, exc)
                after = g
                continue
            if info.get("action") == "stop":
                raise StopRequested(info.get("reason", "the agent stopped the job"))
            return

    def _next_generation(self, after: int):
        deadline = time.monotonic() + self.wait_s + self.timeout_s
        while True:
            try:
                g = int(self.store.get("gen/current"))
                if g > after:
                    return g, protocol.decode(self.store.get(protocol.generation_key(g)))
            except Exception as exc:
                raise AgentLost(f"the agent's store at {self.address} stopped answering ({exc})") from exc
            if time.monotonic() > deadline:
                raise AgentLost(f"no new generation after {after} within elastic.wait_s + elastic.timeout_s")
            time.sleep(0.005)
