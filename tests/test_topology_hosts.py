"""topology=hierarchical across 2 hosts x 2 workers of the multi-host harness (network namespaces,
tests/hosts.py): grouped by host, summed through each host's leader; a group leader killed hands its role to
the next member of its host, a trainer killed shrinks its group; every run ends on the 1-worker parameters."""
from __future__ import annotations

from conftest import metrics
from hosts import hosts  # noqa: F401 - fixture
from test_elastic import events
from test_hosts import assert_each_sample_once, finish, reference, start_job  # noqa: F401 - fixture
from test_slurm_hosts import assert_close_to_reference  # the bound: 1e-5 of each tensor's largest value


def test_hierarchical_survives_a_leader_and_a_trainer_killed(hosts, tmp_path, reference):
    net = hosts(2)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    # Workers 0, 1 run on h1 (the agent's host), 2, 3 on h2; ranks follow ids, so worker 2 leads h2's group.
    # It dies in the reduction of step 15; worker 1, a plain member of h1's group, in forward of step 35.
    procs = start_job(net, run, ["h1", "h2"], "launcher.nodes=2", "topology=hierarchical",
                      env={"EF_PROBE_KILL": "2:15:reduction,1:35:forward"}, record=record)
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0, out["h1"][-3000:]
    assert_close_to_reference(run, reference)
    assert_each_sample_once(run, record)
    world = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert world[0] == 4 and 3 in world and world[-1] == 2, world
    formed = [e["groups"] for e in events(run) if e["event"] == "groups"]  # worker ids, by host, leader first
    assert formed[0] == [[0, 1], [2, 3]], formed
    # After h2's leader died: h2's group is worker 3 alone, which now leads it. After worker 1 died too, each
    # host has one worker: the flat sum is the same traffic, so no groups are formed (and none recorded).
    assert formed[1:] == [[[0, 1], [3]]], formed
