"""The worker's side of membership: join, heartbeat, notice new generations, rebuild the group.

A background thread, on its own store connection (a store client is not shared across threads),
bumps this worker's heartbeat and reads ``gen/current`` every ``POLL_S``: the training thread
sees the newest generation without a round trip, and learns within ``POLL_S`` when the agent is
gone. A stopped process (SIGSTOP) stops heartbeating, which is how the agent finds hung workers.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
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


class Refused(Exception):
    """The agent refused to admit this worker (wrong or missing job token, or the job is full)."""


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

    def __init__(self, address: str, worker_id: Optional[int], timeout_s: float, wait_s: float,
                 token: Optional[str], host: str = "127.0.0.1"):
        self.address, self.worker_id, self.token = address, worker_id, token
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
            beat = f"worker/{self.worker_id}/hb"
            while not self._stop.wait(POLL_S):
                store.add(beat, 1)
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
        """Ask the agent to admit this worker (signed with the job token), then enter the first
        generation that lists it. Call when ready to train: the agent adds joiners at once."""
        n = int(self.store.add("join/count", 1))
        wid = -1 if self.worker_id is None else self.worker_id
        request = {"n": n, "id": wid, "pid": os.getpid(), "host": socket.gethostname()}
        request["mac"] = protocol.sign(self.token, f"{n}:{wid}:{os.getpid()}") if self.token else ""
        self.store.set(f"join/request/{n}", json.dumps(request))
        try:
            self.store.wait([f"join/verdict/{n}"], datetime.timedelta(seconds=self.wait_s + self.timeout_s))
            verdict = protocol.decode(self.store.get(f"join/verdict/{n}"))
        except Exception as exc:
            raise AgentLost(f"the agent at {self.address} did not answer the join request ({exc})") from exc
        if not verdict.get("ok"):
            raise Refused(verdict.get("reason", "refused"))
        self.worker_id = int(verdict["id"])
        self.admitted_at = time.time()
        self._poller.start()
        self.rebuild(after=-1)

    def report_failure(self) -> None:
        """Tell the agent a collective of this generation failed (it hunts for hung members)."""
        try:
            self.store.set(f"gen/{self.generation}/failed/{self.worker_id}", str(time.time()))
        except Exception:
            pass  # the agent is gone; the rebuild that follows will say so

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
                if self.generation < 0:  # admitted, but not yet in a published generation
                    after = g
                    continue
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
