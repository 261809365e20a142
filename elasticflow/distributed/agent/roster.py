"""The agent's one record of its workers' lifecycle: each worker it knows sits in exactly one place.

    spawn --> joining --admitted--> admitted --publish--> members --exit--> finished
                                        ^                   |  ^
                                        +--arrived-- waiting <--left out of a generation that failed to form
    members, waiting --scale-down--> retiring --exit--> (gone)

A worker's ``state`` (what workers.json and ``elasticflow status`` show) is written here only, as it moves:
the list a worker is in and its state cannot disagree. ``cut`` marks a worker the agent killed for silence
("killed") while it stays in its place until its exit is seen; ``end`` gives the last generation's members
their exit's wording once the job is over. Places hold the agent's order: ``members`` is rank order.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from .process import Worker

# Each place and the state a worker there shows (members are "training").
STATES = {"joining": "joining", "admitted": "admitted", "members": "training", "waiting": "waiting",
          "retiring": "retiring", "finished": "finished"}


class Roster:
    """The agent's workers by place. Read the places freely; move workers only through ``add``, ``move``,
    ``drop``, ``cut`` and ``end``."""

    def __init__(self) -> None:
        self.joining: Dict[int, Worker] = {}  # spawned, join request not yet accepted (by worker id)
        self.admitted: List[Worker] = []      # accepted, enter at the next generation
        self.members: List[Worker] = []       # the published generation, rank order
        self.waiting: List[Worker] = []       # alive, left out of a generation that failed to form
        self.retiring: List[Worker] = []      # dropped by a scale-down, exiting at a step boundary
        self.finished: List[Worker] = []      # exited after a member's (or a waiting worker's) end

    def place_of(self, w: Worker) -> Optional[str]:
        if self.joining.get(w.id) is w:
            return "joining"
        for place in ("admitted", "members", "waiting", "retiring", "finished"):
            if any(x is w for x in getattr(self, place)):
                return place
        return None

    def add(self, w: Worker, place: str = "joining") -> Worker:
        """A worker the agent did not know (spawned, or admitted from elsewhere) enters ``place``."""
        assert self.place_of(w) is None, f"worker {w.id} is already {self.place_of(w)}"
        self._put(w, place)
        return w

    def move(self, w: Worker, place: str) -> None:
        """``w`` leaves its place and goes to the end of ``place``."""
        self.drop(w)
        self._put(w, place)

    def move_all(self, workers: Iterable[Worker], place: str) -> None:
        for w in list(workers):
            self.move(w, place)

    def drop(self, w: Worker) -> None:
        """``w`` leaves the roster (it exited, lost or retired, or its start was cancelled)."""
        if self.joining.get(w.id) is w:
            del self.joining[w.id]
        for place in ("admitted", "members", "waiting", "retiring", "finished"):
            items = getattr(self, place)
            items[:] = [x for x in items if x is not w]

    def cut(self, w: Worker) -> None:
        """The agent killed ``w`` for silence; it stays where it is until its exit is seen."""
        w.state = "killed"

    def end(self, published: List[Worker], states: List[str]) -> None:
        """The job is over: the last generation's members, as published, each with how it ended."""
        for w, state in zip(published, states):
            w.state = state
        self.members = list(published)

    def live(self) -> List[Worker]:
        return [*self.members, *self.joining.values(), *self.admitted, *self.retiring, *self.waiting]

    def _put(self, w: Worker, place: str) -> None:
        if place == "joining":
            self.joining[w.id] = w
        else:
            getattr(self, place).append(w)
        w.state = STATES[place]
