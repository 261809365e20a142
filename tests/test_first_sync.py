"""The first state sync (``Replica.sync_state`` as a worker joins) fails like any other collective: the members
regroup and sync again, and the job goes on. Issue #65: a stranger who connected to a worker's gloo port before
its peer did was handed the peer's connection; the first sync waited on it until elastic.timeout_s, and that
failure, unlike one in a step, ended the job (exit 1, no checkpoint): tests/test_hosts.py's
test_a_stranger_on_another_host_at_a_gloo_port_costs_one_regroup_not_the_job causes that across a network."""
from harness import STEPS, assert_equivalent, events, metrics, train_ok


def test_a_member_lost_in_the_first_state_sync_regroups_and_the_job_goes_on(tmp_path, reference):
    run = tmp_path / "run"
    # Worker 1 dies in its first sync, before it sends: the others' first sync fails while they wait for it.
    out = train_ok(run, "launcher.workers=3", env={"EF_PROBE_KILL": "1:0:sync"})
    assert_equivalent(run, reference)  # the final checkpoint, on the 1-worker parameters
    recovered = events(run, "recovered")
    assert recovered and recovered[0]["step"] == 0 and recovered[0]["world_size"] == 2, out[-4000:]
    assert len(events(run, "left")) == 1
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[1] == 2 and world[STEPS] == 2
