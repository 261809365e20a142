"""Topologies across 2 hosts x 2 workers of the multi-host harness (network namespaces, tests/hosts.py).
hierarchical: grouped by host, summed through each host's leader; a group leader killed hands its role to the
next member of its host, a trainer killed shrinks its group; in trainer.reproducible it ends on the 1-worker
run's bits. diloco: a
trainer killed mid-round costs the round; it ends on the plain loop's parameters (tests/test_rounds.py).
parameter_server: an aggregator, the leader and a trainer killed; it ends on the 1-worker parameters."""
from __future__ import annotations

from harness import (assert_bitwise, assert_each_sample_once, assert_equivalent, events, finish, logged_step, metrics,
                     start_on_hosts, wait_for, workers)
from harness import plain_rounds as plain
from hosts import hosts  # noqa: F401 - fixture


def test_hierarchical_survives_a_leader_and_a_trainer_killed(hosts, tmp_path, one_worker):
    """In trainer.reproducible (docs/exactness.md): the run must end on the 1-worker run's bits, not near them.
    (The default mode's hierarchical sums, with a leader killed: tests/test_hierarchy.py.)"""
    net = hosts(2)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    exact = ["trainer.reproducible=true", "trainer.micro_batch_size=16"]
    # Workers 0, 1 run on h1 (the agent's host), 2, 3 on h2; ranks follow ids, so worker 2 leads h2's group.
    # It dies in the reduction of step 15; worker 1, a plain member of h1's group, in forward of step 35.
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "topology=hierarchical", *exact,
                           env={"EF_PROBE_KILL": "2:15:reduction,1:35:forward"}, record=record)
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0, out["h1"][-3000:]
    assert_bitwise(run, one_worker(*exact))
    assert_each_sample_once(run, record)
    world = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert world[0] == 4 and 3 in world and world[-1] == 2, world
    formed = [e["groups"] for e in events(run) if e["event"] == "groups"]  # worker ids, by host, leader first
    assert formed[0] == [[0, 1], [2, 3]], formed
    # After h2's leader died: h2's group is worker 3 alone, which now leads it. After worker 1 died too, each
    # host has one worker: the flat sum is the same traffic, so no groups are formed (and none recorded).
    assert formed[1:] == [[[0, 1], [3]]], formed


def test_diloco_across_two_hosts_survives_a_trainer_killed_and_ends_on_the_plain_loop(hosts, tmp_path):
    net = hosts(2)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    # Four replicas, one per worker (0, 1 on h1; 2, 3 on h2), rounds of 4 steps. Worker 2 dies in its replica's
    # second inner step of round 25-28: the others fail at the round's sum and worker 3 trains replica 2 again
    # beside its own (4 replicas on 3 workers: ranks 0, 0, 1, 2), from the round's start.
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "topology=diloco", "topology.replicas=4",
                      "topology.sync_every=4", env={"EF_PROBE_KILL": "2:26:forward"}, record=record)
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0, out["h1"][-3000:]
    expect, expect_losses = plain("diloco", 4, 4, 60)
    assert_equivalent(run, expect)
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 61))
    assert [r["world_size"] for r in records][23:25] == [4, 3]
    recovered = [e for e in events(run) if e["event"] == "recovered"]
    assert [e["step"] for e in recovered] == [24], recovered
    assert_each_sample_once(run, record)


def test_parameter_servers_survive_an_aggregator_the_leader_and_a_trainer_killed(hosts, tmp_path, reference):
    net = hosts(2)
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    # Three processes per host (workers 0-2 on h1, 3-5 on h2): one shard, a primary and a standby, dealt one
    # per host (worker 5 on h2, worker 2 on h1); workers 0, 1, 3, 4 train. The primary is SIGKILLed while the
    # trainers sit in step 20's forward; rank 0 (the job's leader, a trainer) dies in step 35's reduction and
    # worker 3 (a trainer on h2) in step 45's forward.
    procs = start_on_hosts(net, run, ["h1", "h2"], "launcher.nodes=2", "launcher.procs_per_node=3",
                      "topology=parameter_server", "topology.replica=2",
                      env={"EF_PROBE_PAUSE": "20:2.0", "EF_PROBE_KILL": "0:35:reduction,3:45:forward"}, record=record)
    wait_for(lambda: logged_step(run) >= 18, 120, "step 18")  # step 19's record is written as step 20 reduces
    roles = [e for e in events(run) if e["event"] == "roles"]
    assert roles[0]["primaries"] == [5] and roles[0]["standbys"] == [2] and roles[0]["trainers"] == [0, 1, 3, 4]
    pid = next(w["pid"] for w in workers(run) if w["worker_id"] == 5)  # a pid in h2's namespace
    assert net.run("h2", ["kill", "-9", str(pid)]).returncode == 0
    out = {h: finish(p) for h, p in procs.items()}
    assert procs["h1"].returncode == 0, out["h1"][-3000:]
    assert_equivalent(run, reference)  # every step once, each tensor within 1e-5 of the 1-worker run
    assert_each_sample_once(run, record)
    assert not [e for e in events(run) if e["event"] == "fell_back"]  # no step lost to a checkpoint
    roles = [e for e in events(run) if e["event"] == "roles"]
    assert roles[1]["primaries"] == [2] and roles[1]["standbys"] == [4], roles  # the standby took over
    assert roles[-1]["primaries"] == [2] and roles[-1]["trainers"] == [1], roles
    world = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert world[0] == 6 and world[-1] == 3, world
