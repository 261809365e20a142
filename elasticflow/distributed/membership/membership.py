"""The worker's side of membership: join, heartbeat, notice new generations, rebuild the group.

A background thread, on its own store connection (a store client is not shared across threads),
bumps this worker's heartbeat and reads ``gen/current`` every ``POLL_S`` (``beat_s``: slower past 64
members): the training thread sees the newest generation without a round trip, and learns within that
interval when the agent is gone. A stopped process (SIGSTOP) stops heartbeating, which is how the agent finds
hung workers.

Every record read here is sealed by its writer (_util/sealing.py); one that does not verify is refused and
ignored -- a stranger who can reach the store cannot stop the job, or enter it, by writing records.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from torch.distributed import PrefixStore

from ..._util import links
from ..._util.fileio import append_event
from ..._util.memory import rss_mib
from .. import protocol
from ..store import stores
from ..comm.comm import Group
from ..protocol import CommError
from .rendezvous import DIRECT_ARRIVALS, failures_key, go_key, key, poll_s

log = logging.getLogger("elasticflow")
POLL_S = 0.05
BEAT_MEMBERS = 64  # past this many members, the heartbeat and gen/current poll slow down in proportion (beat_s)
MEMORY_POLLS = 40  # every 40 polls (2 s): the workers' resident memory
VERDICT_S = 5.0  # a join request unanswered this long was lost (a stranger deleted or overwrote it): ask again
JOIN_TRIES = 6
UNVERIFIED_S = 3.0  # job/check not verifying this long (the agent puts back a stranger's within a round): wrong token


def beat_s(members: int) -> float:
    """How often the membership thread beats and polls: POLL_S up to BEAT_MEMBERS members, then slower in
    proportion, up to 0.5 s, so the store serves a bounded load (1,024 members every 50 ms: 40k calls a second). A
    new generation is still seen within a few ms by one member or another, and the step's votes tell the rest."""
    return min(0.5, POLL_S * max(1.0, members / BEAT_MEMBERS))


class StopRequested(Exception):
    """The agent ended the job (e.g. fewer than launcher.min_workers for elastic.wait_s)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class AgentLost(Exception):
    """The agent's store stopped answering."""


class Removed(Exception):
    """The newest generation does not include this worker: retired (a scale-down), or ``cut`` out by the agent
    (it stopped heartbeating: hung, or its host was cut off)."""

    def __init__(self, message: str, cut: bool = False):
        super().__init__(message)
        self.cut = cut


class Refused(Exception):
    """The agent refused to admit this worker (wrong or missing job token, or the job is full)."""


def _connect(address: str, timeout_s: float, token: Optional[str] = None):
    return stores.connect(address, timeout_s, token)


class Membership:
    """This worker's view: generation, rank, world size and the generation's ``Group``.

    Args:
        address: the agent's store, ``unix:<path>`` or ``host:port`` (store/stores.py).
        worker_id: this worker's id (stable for the life of the process).
        timeout_s: collective and rendezvous timeout (``elastic.timeout_s``).
        wait_s: ``elastic.wait_s`` (kept for the caller; the agent, not the worker, applies it).
    """

    def __init__(self, address: str, worker_id: Optional[int], timeout_s: float, wait_s: float,
                 token: Optional[str], host: str = "127.0.0.1", node: Optional[str] = None):
        self.address, self.worker_id, self.token, self.node = address, worker_id, token, node
        self.timeout_s, self.wait_s, self.host = timeout_s, wait_s, host
        try:
            self.store = _connect(address, timeout_s, token)
        except stores.WrongToken as exc:
            raise Refused(f"wrong or missing job token ({exc})") from None
        self.generation = -1
        self.rank, self.world = 0, 1
        self.members: List[int] = []
        self.record: dict = {}  # the generation's record as the agent published it (protocol.encode)
        self.group: Optional[Group] = None
        self.nccl_device = None  # this worker's GPU when comm.backend=nccl (set by the trainer before join)
        self.group_tag: Optional[str] = None  # topology=hierarchical: this worker's group (set before join)
        self.events: Optional[Path] = None    # RUN_DIR/events.jsonl, where rank 0 records each generation's groups
        self.latest_generation = 0
        self._gone_read = -1  # the newest generation whose record the poller read for members gone
        # Worker ids the agent declared gone (dead, hung, cut off: a generation record's "gone"). Such an id never
        # comes back (a replacement has a new one): a save's rank 0 stops waiting for their reports (save.py).
        self.departed: set = set()
        self.agent_lost = False
        self.device: Optional[str] = None   # what report_device was given
        self.memory: Dict[int, float] = {}  # rank 0: resident MiB by member id, refreshed every 2 s (_share_memory)
        self.sealer = protocol.Sealer(token or "")  # for the run's job once the join verdict names it
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="elasticflow-membership", daemon=True)

    def new_client(self):
        """A client of the agent's store on a connection of its own (for a thread of its own)."""
        return _connect(self.address, self.timeout_s, self.token)

    # -- background
    def _poll(self) -> None:
        try:
            store = _connect(self.address, self.timeout_s, self.token)
            beat = f"worker/{self.worker_id}/hb"
            polls, gathered_in = 0, None
            while not self._stop.wait(beat_s(len(self.members))):
                protocol.put(store, self.sealer, beat, str(polls))  # a sequence: a replayed beat is an old one
                g = protocol.fetch(store, self.sealer, "gen/current", "gen/current")
                if g is not None:
                    self.latest_generation = max(self.latest_generation, int(g))
                if self.latest_generation > self.generation:
                    self._abort_if_a_member_left(store)  # a failure here ends the loop: agent_lost
                if polls % MEMORY_POLLS == 0 or gathered_in != self.generation:  # and at once for new members
                    generation = self.generation
                    if self._share_memory(store):
                        gathered_in = generation
                polls += 1
        except Exception:  # the agent's store is gone
            if not self._stop.is_set():
                self.agent_lost = True

    def _share_memory(self, store) -> bool:
        """Publish this worker's resident memory; on rank 0, read every member's (``memory``) for the step
        records. Here, not in the step: a store round trip per member would cost the training thread."""
        protocol.put(store, self.sealer, protocol.memory_key(self.worker_id), f"{rss_mib():.1f}")
        if self.rank != 0 or self.generation < 0:
            return True
        memory = {}
        for i in self.members:
            mib = protocol.fetch(store, self.sealer, protocol.memory_key(i), "memory")
            if mib is not None:
                memory[i] = float(mib)
        self.memory = memory
        return len(memory) == len(self.members)  # False: a member has not published yet; again at the next poll

    def _abort_if_a_member_left(self, store) -> None:
        """Let this generation's collectives end now when the agent has published one without a member of it,
        and note who left in ``departed``.

        gloo: a member the agent declared gone (dead, hung, or its host silent: a newer generation's ``gone``)
        leaves a collective waiting for its timeout if no FIN or RST comes (a host powered off or cut off), so
        the group's links are cut (``Group.cut_links``), which also aborts an NCCL communicator (a dead peer
        leaves its collective spinning on the GPU). Not for a member that retires: it leaves at a step boundary,
        on this group, after it handed its sharded state over on it (NCCL's as well: aborting for a member merely
        missing from the newest generation once failed every scale-down's hand-off)."""
        group = self.group
        if group is None:  # not a member yet: its first generation's record says who is gone (rebuild)
            return
        for g in range(max(group.generation, self._gone_read) + 1, self.latest_generation + 1):
            newest = self._generation(store, g)
            if newest is None:
                return  # not readable yet: at the next poll
            self._gone_read = g
            gone = set(newest.get("gone", []))
            self.departed |= gone  # in place: a save's rank 0 reads this set from its writer thread
            if not group.cut and set(group.members) & gone:
                group.cut_links()

    def close(self) -> None:
        self._stop.set()
        if self.group is not None:
            self.group.close()

    # -- joining and rebuilding
    def join(self) -> None:
        """Ask the agent to admit this worker (signed with the job token), then enter the first
        generation that lists it. Call when ready to train: the agent adds joiners at once."""
        verdict = None
        for _ in range(JOIN_TRIES):  # a request a stranger deleted or overwrote gets no answer: ask again
            try:
                verdict = self._ask(time.monotonic() + VERDICT_S)
            except Exception as exc:  # a worker that started as the job ended
                raise AgentLost(f"the agent at {self.address} did not answer the join request "
                                f"({str(exc).splitlines()[0][:120]})") from exc
            if verdict is not None:
                break
        if verdict is None:
            raise AgentLost(f"the agent at {self.address} answered none of {JOIN_TRIES} join requests in "
                            f"{VERDICT_S:.0f} s each")
        if not verdict.get("ok"):
            raise Refused(str(verdict.get("reason", "refused")))
        self.sealer = self.sealer.for_job(str(verdict["job"]))
        unreported = self.worker_id is None and self.device is not None
        self.worker_id = int(verdict["id"])
        if unreported:
            self.report_device(self.device)
        self.admitted_at = time.time()
        self._poller.start()
        self.rebuild(after=-1)

    def check_token(self) -> None:
        """Before anything touches the run's files: a worker whose token does not verify the agent's
        ``job/check`` record asks to join at once, to be refused (and logged by the agent), rather than
        reach the checkpoint folder as a stranger. Raises Refused or AgentLost."""
        sealer, deadline = protocol.Sealer(self.token or ""), time.monotonic() + UNVERIFIED_S
        try:
            # A stranger's replacement of job/check is put back by the agent within a health round: only a
            # record that does not verify for UNVERIFIED_S says that our token is wrong.
            while protocol.fetch(self.store, sealer, "job/check", "job check") is None:
                if time.monotonic() > deadline:
                    self._ask(deadline)  # once, without waiting for an answer: the agent logs the refusal
                    raise Refused("the agent's records do not verify with this worker's job token (wrong or "
                                  "missing token)")
                time.sleep(POLL_S)
        except Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is gone
            raise AgentLost(f"the agent at {self.address} is gone ({str(exc).splitlines()[0][:120]})") from exc

    def _ask(self, deadline: float) -> Optional[dict]:
        """Count a join request, write it, and return the agent's verdict (None: no answer by ``deadline``)."""
        n = protocol.draw(self.store, "join/count", "join/count")
        wid = -1 if self.worker_id is None else self.worker_id
        host, nonce = socket.gethostname(), secrets.token_hex(8)
        request = {"n": n, "id": wid, "pid": os.getpid(), "host": host, "node": self.node, "nonce": nonce}
        message = protocol.join_message(n, wid, os.getpid(), self.node, host, nonce)
        request["mac"] = protocol.sign(self.token, message) if self.token else ""
        self.store.set(f"join/request/{n}", json.dumps(request))
        return self._verdict(n, nonce, deadline)

    def _verdict(self, n: int, nonce: str, deadline: float) -> Optional[dict]:
        """The agent's sealed answer to join request ``n`` (ours: it names our ``nonce``), or None at ``deadline``.

        The agent answers within its next round (~50 ms). An answer that does not verify is a stranger's, and is
        waited past (check_token found our token good: the agent's would verify).
        """
        key = protocol.verdict_key(n)
        while time.monotonic() < deadline:
            raw = protocol.read(self.store, key)
            if raw is not None:
                try:
                    verdict = protocol.loads(self.sealer.open(key, raw))
                    if isinstance(verdict, dict) and verdict.get("nonce") == nonce:
                        return verdict
                except (protocol.Forged, ValueError):
                    pass
            time.sleep(0.01)
        return None

    def report_device(self, text: str) -> None:
        """Publish where this worker computes (``Placement.describe()``) for `elasticflow status`.

        Sets store key ``worker/<id>/device``. Before ``join`` a worker started without an id (not by
        the agent) has no key yet: the text is published when the agent assigns one.
        """
        self.device = text
        if self.worker_id is None:
            return
        try:
            self.store.set(protocol.device_key(self.worker_id), text)
        except Exception:
            pass  # only `status` reads it; a store that stopped answering is the next rebuild's to report

    def report_role(self, role: str) -> None:
        """Publish this worker's role (``protocol.role_key``): a scale-down retires trainers before aggregators,
        whose shards would otherwise have to move first (``Scaling.rescale``, agent/scaling.py)."""
        try:
            self.store.set(protocol.role_key(self.worker_id), role)
        except Exception:
            pass  # a hint only: the retirement order is the next rebuild's to get right

    def report_failure(self, generation: Optional[int] = None) -> None:
        """Tell the agent that building ``generation``'s group, or a collective of the current one, failed."""
        g = self.generation if generation is None else generation
        try:
            protocol.put(self.store, self.sealer, key(g, "failed", self.worker_id), str(time.time()))
            protocol.draw(self.store, failures_key(g), "failures")  # the agent reads the keys when this moves
        except Exception:
            pass  # the agent is gone; the rebuild that follows will say so

    def rebuild(self, after: int) -> None:
        """Drop the current group; build the group of the first generation newer than ``after``.

        Waits as long as the agent's store answers: the agent, not this worker, decides when a
        generation failed (it publishes the next) or when the job stops. Raises StopRequested,
        Removed or AgentLost.
        """
        if self.group is not None:
            self.group.close()
            self.group = None
        while True:
            g, info = self._next_generation(after)
            self.departed |= set(info.get("gone", []))
            members = info["members"]
            after = g
            if self.worker_id not in members:
                if info.get("action") == "stop":  # the job ended (or stops) without us: nothing to wait for
                    raise Removed(f"generation {g} stops the job without worker {self.worker_id}: "
                                  f"{info.get('reason', '')}")
                # A joiner not yet let in, or a worker left out of a generation that failed to form: say
                # we are ready, so the agent lets us into the next one.
                if self.generation >= 0 and self.worker_id not in info.get("waiting", []):
                    self._removed(g)
                self._mark(g, "arrived")
                continue
            self._mark(g, "arrived")
            if not self._everyone_arrived(g, members):
                continue  # superseded before it formed
            rank, world = members.index(self.worker_id), len(members)
            try:
                # Under a prefix only token holders can compute: gloo's rendezvous keys are read unsealed.
                gloo_store = PrefixStore(f"{self.sealer.name('gloo')}/", self.store)
                before = links.sockets()
                group = Group(gloo_store, g, rank, world, self.timeout_s, self.host, self.nccl_device,
                              self.group_tag, superseded=lambda: self._replaced(g))
                group.members, group.links = members, links.opened_since(before, stores.port_of(self.address))
            except CommError as exc:
                log.warning("worker %d: %s; the agent publishes the next generation", self.worker_id, exc,
                            extra={"console": os.environ.get(protocol.ENV_DEBUG) == "1"})  # gloo's text: --debug
                if not self._replaced(g):  # the agent has moved on already: nothing to report
                    self.report_failure(g)
                continue
            self._mark(g, "formed")
            self.group, self.generation, self.members, self.rank, self.world = group, g, members, rank, world
            self.record = info
            if group.hierarchy is not None and rank == 0 and self.events is not None:
                append_event(self.events, "groups", "worker", generation=g,
                             groups=[[members[r] for r in grp] for grp in group.hierarchy.groups])
            if info.get("action") == "stop":
                raise StopRequested(info.get("reason", "the agent stopped the job"))
            return

    def _removed(self, g: int) -> None:
        cut = protocol.cut_key(self.worker_id)
        try:
            why = protocol.fetch(self.store, self.sealer, cut, "cut")
        except Exception as exc:
            raise AgentLost(f"the agent's store at {self.address} stopped answering ({exc})") from exc
        if why is not None:
            raise Removed(f"the agent cut worker {self.worker_id} out of the job in generation {g}: {why}", cut=True)
        raise Removed(f"generation {g} does not include worker {self.worker_id}")

    def _mark(self, g: int, what: str) -> None:
        try:
            protocol.put(self.store, self.sealer, key(g, what, self.worker_id), str(time.time()))
        except Exception as exc:
            raise AgentLost(f"the agent's store at {self.address} stopped answering ({exc})") from exc

    def _everyone_arrived(self, g: int, members: List[int]) -> bool:
        """Wait until every member of ``g`` arrived (True) or the agent published a newer one (False).

        Gloo's rendezvous starts only then, so its timeout is not spent on a peer still busy in an
        older generation. Unbounded here on purpose: the agent supersedes g after elastic.timeout_s.
        A small generation reads every member's arrival; a large one waits for the agent's ``gen/<g>/go``
        (rendezvous.DIRECT_ARRIVALS says why).
        """
        direct = len(members) <= DIRECT_ARRIVALS
        keys = [key(g, "arrived", i) for i in members] if direct else [go_key(g)]
        while True:
            try:
                if self.store.check(keys) and all(
                        protocol.fetch(self.store, self.sealer, k, "arrival" if direct else "go") for k in keys):
                    return True
                if self._current(self.store) > g:
                    return False
            except Exception as exc:
                raise AgentLost(f"the agent's store at {self.address} stopped answering ({exc})") from exc
            time.sleep(poll_s(len(members)))

    def upcoming(self, after: int):
        """(generation, its record) of the newest generation after ``after``, before entering it: who
        will be a member (a member about to retire hands its sharded state over first). Waits as
        ``rebuild`` does."""
        return self._next_generation(after)

    def _next_generation(self, after: int):
        """The newest generation after ``after``; waits while the store answers (the agent decides)."""
        while True:
            try:
                g = self._current(self.store)
                info = self._generation(self.store, g) if g > after else None
                if info is not None:
                    return g, info
            except Exception as exc:
                raise AgentLost(f"the agent's store at {self.address} stopped answering ({exc})") from exc
            if self.agent_lost:  # the heartbeat thread's connection failed too
                raise AgentLost(f"the agent's store at {self.address} stopped answering")
            time.sleep(poll_s(max(self.world, len(self.members))))  # scaled: every waiting member polls

    def _replaced(self, g: int) -> bool:
        """Whether the agent has published a generation newer than ``g`` (False if the store does not answer:
        what follows finds that out and says so)."""
        try:
            return self._current(self.store) > g
        except Exception:  # noqa: BLE001
            return False

    def _current(self, store) -> int:
        """The newest generation the agent published (a forged ``gen/current`` leaves what we knew)."""
        g = protocol.fetch(store, self.sealer, "gen/current", "gen/current")
        return -1 if g is None else int(g)

    def _generation(self, store, g: int) -> Optional[dict]:
        """Generation ``g``'s record; None while it is absent or forged (the agent's own replaces a forgery
        within its next health round: agent.reassert)."""
        info = protocol.fetch_json(store, self.sealer, protocol.generation_key(g), "generation")
        if info is not None and not isinstance(info.get("members"), list):
            return None
        return info
