"""The agent's state, in one place: the job's identity and secrets, its store, its workers (the roster) and the
generation's bookkeeping, with the three writes every part makes (an event, a sealed record, a worker id).

The agent (agent.py) builds one ``AgentState`` and hands it to each of its parts (admission, health, scaling,
processes, generations, hosts, the workers file, leadership's handover): they read and change the job through it,
and none of them knows the agent. What a part alone uses (an inbox, a cursor, a back-off) stays in that part.
"""
from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..._util.fileio import append_event
from .. import protocol
from .process import Worker
from .roster import Roster


class AgentState:
    """What the agent knows of its job. ``token``: the job's shared secret (None: a new random one); ``job``:
    this run's id (None: a new one). ``store`` and ``address`` are the agent's to set once it serves the store
    (None after ``Agent._close_store``)."""

    def __init__(self, cfg: Any, run_dir: Path, host: str, token: Optional[str] = None, job: Optional[str] = None):
        self.cfg, self.run_dir, self.host = cfg, Path(run_dir), host
        self.state_dir = self.run_dir / ".elasticflow"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token = protocol.new_token(self.run_dir, token)
        self.job = job or secrets.token_hex(8)  # this run's id, inside every record's MAC (_util/sealing.py)
        self.sealer = protocol.Sealer(self.token, self.job)
        self.verdicts = protocol.Sealer(self.token)  # join verdicts: they hand the job id out
        self.record: Dict[str, str] = {}      # the agent's own records as sealed, put back if a stranger replaces one
        self.store: Any = None                # the job's store (a dist.Store), and where it listens
        self.address = ""
        self.generation = -1                  # nothing published yet
        self.roster = Roster()                # every worker, in one place of its lifecycle (roster.py)
        self.published: List[Worker] = []    # the published generation's members as published (they leave
                                             # roster.members as they exit)
        self.restarts = 0
        self.dirty = False                    # members changed since the last publish
        self.gone: List[int] = []             # members declared gone since the last publish (its record's "gone")
        self.causes: Dict[int, str] = {}      # why each of them went (its record's "causes": rank 0's console line)
        self.trained = False                  # a member finished training (exit 0): nothing more is published
        self.supersede_at: Optional[float] = None  # a failed generation's successor is due then (back-off)
        self.supersede_cause = ""
        self.stop_reason = ""
        self.interrupted = False
        self.preempted = False
        self.started = time.monotonic()       # when the job started (the agent restamps it once its store serves)

    # The roster's places, to read (moves go through self.roster).
    members = property(lambda self: self.roster.members, doc="the published generation, rank order")
    joining = property(lambda self: self.roster.joining, doc="spawned, join request not yet accepted")
    admitted = property(lambda self: self.roster.admitted, doc="accepted, enter at the next generation")
    waiting = property(lambda self: self.roster.waiting, doc="alive, left out of a generation that failed")
    retiring = property(lambda self: self.roster.retiring, doc="leaving after a scale-down")
    finished = property(lambda self: self.roster.finished, doc="exited after training or a clean stop")

    def live(self) -> List[Worker]:
        return self.roster.live()

    def target_workers(self) -> int:
        return len(self.members) + len(self.admitted) + len(self.joining) + len(self.waiting)

    def new_id(self) -> int:
        """The next worker id, from the store's counter: node agents on other hosts draw from it too."""
        return protocol.draw(self.store, protocol.IDS_KEY, protocol.IDS_KEY) - 1

    def put(self, key: str, payload: str) -> None:
        """Write one of the agent's own records, sealed, and remember it (``Health.reassert``)."""
        self.record[key] = self.sealer.seal(key, payload)
        self.store.set(key, self.record[key])

    def event(self, kind: str, **fields) -> None:
        append_event(self.run_dir / "events.jsonl", kind, "agent", **fields)
