"""topology=hierarchical at the collective level: real processes on loopback, grouped by a tag."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from harness import REPO, assert_equivalent, events, saved, train_ok

# argv: rank world port tags(comma) mode
RANK = r"""
import datetime, hashlib, json, os, signal, sys, time
import numpy as np, torch
import torch.distributed as dist
from elasticflow.distributed.comm import hierarchy
from elasticflow.distributed.comm.comm import Group
from elasticflow.distributed.protocol import CommError

rank, world, port, tags, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), sys.argv[5]
if mode == "chunks":
    hierarchy.CHUNK_BYTES = 256 << 10  # the 1.2 MB sum in 5 pipelined pieces
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
group = Group(store, 0, rank, world, timeout_s=10, group_tag=tags[rank])
h = group.hierarchy
out = {"rank": rank, "hierarchical": h is not None}
if h is not None:
    out.update(leader=h.leader, groups=h.groups)
rows = [torch.from_numpy(np.random.default_rng(r).standard_normal(300_000).astype(np.float32)) for r in range(world)]
if mode == "kill-leader" and rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    mine = rows[rank].clone()
    work = group.allreduce_start(mine)
    group.wait(work)
    small = torch.tensor([float(rank)], dtype=torch.float64)
    group.allreduce_(small)
    low = torch.tensor([float(rank + 5)])
    group.allreduce_(low, op="min")
    expect = torch.stack([r.double() for r in rows]).sum(0)
    out.update(digest=hashlib.sha1(mine.numpy().tobytes()).hexdigest(), started=type(work).__name__,
               worst=float(((mine.double() - expect).abs() / expect.abs().clamp(min=1)).max()),
               small=float(small), low=float(low), chunks=len(work.chunks) if h is not None else 0)
except CommError as exc:
    out["error"] = str(exc)
print(json.dumps(out), flush=True)
os._exit(0)
"""


def run_ranks(tmp_path, tags, mode="sum"):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = len(tags)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), ",".join(tags), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=90)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        outs.append(json.loads(lines[-1]) if lines else {"died": p.returncode, "stderr": stderr[-2000:]})
    return outs


@pytest.fixture(scope="module")
def two_groups_of_two(tmp_path_factory):
    """The whole sum of 4 interleaved ranks in 2 groups: read by the two tests below (one run of 4 processes)."""
    return run_ranks(tmp_path_factory.mktemp("two_groups"), ["h1", "h2", "h1", "h2"])


def test_two_groups_of_two_sum_through_their_leaders_with_every_member_holding_the_same_bits(two_groups_of_two):
    outs = two_groups_of_two  # interleaved ranks: groups by tag, not by position
    assert all(o["hierarchical"] for o in outs), outs
    assert outs[0]["groups"] == [[0, 2], [1, 3]]
    assert [o["leader"] for o in outs] == [True, True, False, False]
    assert {o["started"] for o in outs} == {"HierarchicalSum"}
    assert len({o["digest"] for o in outs}) == 1, "every member ends with the leader's bits"
    assert max(o["worst"] for o in outs) < 1e-6  # the flat sum, to float32 rounding
    assert {o["small"] for o in outs} == {6.0} and {o["low"] for o in outs} == {5.0}  # allreduce_ sum and min


def test_a_sum_pipelined_in_pieces_is_the_same_sum(tmp_path, two_groups_of_two):
    whole = two_groups_of_two
    pieces = run_ranks(tmp_path, ["h1", "h2", "h1", "h2"], mode="chunks")
    assert {o["chunks"] for o in whole} == {1} and {o["chunks"] for o in pieces} == {5}
    assert {o["digest"] for o in pieces} == {o["digest"] for o in whole}, "the same bits, piece by piece"


def test_uneven_groups_and_a_lone_member(tmp_path):
    outs = run_ranks(tmp_path, ["a", "a", "a", "b"])
    assert outs[0]["groups"] == [[0, 1, 2], [3]]
    assert len({o["digest"] for o in outs}) == 1 and max(o["worst"] for o in outs) < 1e-6


@pytest.mark.parametrize("tags", [["a", "a", "a"], ["a", "b", "c"], ["a", "b"]], ids=["one-group", "all-apart", "two"])
def test_no_hierarchy_where_it_cannot_cut_traffic(tmp_path, tags):
    outs = run_ranks(tmp_path, tags)
    assert not any(o["hierarchical"] for o in outs)
    assert len({o["digest"] for o in outs}) == 1


def test_a_dead_leader_fails_the_sum_on_every_survivor(tmp_path):
    outs = run_ranks(tmp_path, ["h1", "h1", "h2", "h2"], mode="kill-leader")  # rank 2 leads h2
    assert outs[2].get("died") == -9
    for o in (outs[0], outs[1], outs[3]):
        assert "error" in o and "generation 0" in o["error"], o


# ---------------------------------------------------------------------------------------------------------
# Whole jobs on one host: topology.group_size=2 makes groups of 2 local slots, so 4 workers form 2 groups.
def test_a_ring_checkpoint_resumes_under_hierarchical_with_a_leader_killed(tmp_path, reference):
    ring, hier = tmp_path / "ring", tmp_path / "hier"
    train_ok(ring, "launcher.workers=2", "checkpoint.interval.steps=30", "checkpoint.keep=null")
    # Workers 0-3 take slots 0-3: groups {0, 1} and {2, 3}. Worker 2 leads the second and dies in the reduction
    # of step 45; its group goes on as worker 3 alone, which leads it.
    train_ok(hier, "launcher.workers=4", "topology=hierarchical", "topology.group_size=2",
             f"resume={saved(ring)['step_30']}", env={"EF_PROBE_KILL": "2:45:reduction"})
    groups = [e["groups"] for e in events(hier) if e["event"] == "groups"]
    assert groups[0] == [[0, 1], [2, 3]] and groups[-1] == [[0, 1], [3]], groups
    # A checkpoint has no topology in it: the resumed run ends where one uninterrupted worker does (its own
    # metrics hold only the steps after the resume).
    assert_equivalent(hier, reference, records=False)
