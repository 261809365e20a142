"""The agent's one record of its workers' lifecycle (distributed/agent/roster.py): a worker is in one place at a
time, its state always says which, and nothing outside the roster writes a worker's state."""
import ast
from pathlib import Path

import pytest

from elasticflow.distributed.agent.process import Worker
from elasticflow.distributed.agent.roster import STATES, Roster

REPO = Path(__file__).resolve().parents[1]


def places(roster, w):
    found = [p for p in STATES if (w in roster.joining.values() if p == "joining" else w in getattr(roster, p))]
    return found


def test_a_worker_is_in_one_place_and_its_state_says_which():
    r = Roster()
    a, b, c = (r.add(Worker(i, 100 + i, None)) for i in range(3))
    assert [w.state for w in (a, b, c)] == ["joining"] * 3 and list(r.joining) == [0, 1, 2]
    r.move_all([c, a, b], "admitted")
    r.move_all(r.admitted, "members")  # the order they were admitted in is their rank order
    assert r.members == [c, a, b] and not r.admitted and not r.joining
    r.move(a, "waiting")  # left out of a generation that failed to form
    r.move(c, "retiring")  # a scale-down
    r.move(a, "admitted")  # it arrived: it enters the next generation
    r.move(b, "finished")
    for w, place in ((a, "admitted"), (b, "finished"), (c, "retiring")):
        assert places(r, w) == [place] and w.state == STATES[place] and r.place_of(w) == place
    r.drop(c)
    assert r.place_of(c) is None and places(r, c) == [] and r.live() == [a]


def test_a_cut_worker_stays_in_its_place_until_it_exits_and_the_end_names_how_each_ended():
    r = Roster()
    a, b = (r.add(Worker(i, 100 + i, None), "members") for i in range(2))
    r.cut(b)
    assert r.members == [a, b] and b.state == "killed"
    r.drop(b)
    r.end([a, b], ["finished", "killed (SIGKILL)"])
    assert r.members == [a, b] and [w.state for w in (a, b)] == ["finished", "killed (SIGKILL)"]


def test_a_known_worker_cannot_be_added_twice():
    r = Roster()
    w = r.add(Worker(0, 100, None))
    with pytest.raises(AssertionError, match="already joining"):
        r.add(w, "admitted")


def test_only_the_roster_writes_a_workers_state():
    """The agent's places and a worker's state were kept apart once (7 lists and a string written in five
    files); now only roster.py assigns ``<worker>.state``. (``self.state``: the agent's parts holding the
    agent's state, distributed/agent/state.py, is no worker's.)"""
    writers = []
    paths = sorted((REPO / "elasticflow" / "distributed").rglob("*.py"))
    assert any(p.name == "processes.py" for p in paths), "the walk missed the agent's modules"
    for path in paths:
        if path.name == "roster.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            writers += [f"{path.name}:{node.lineno}" for t in targets
                        if isinstance(t, ast.Attribute) and t.attr == "state"
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self"
                                 and path.name != "process.py")]  # process.py: Worker's own self.state counts
    assert not writers, f"a worker's state written outside distributed/agent/roster.py: {writers}"
