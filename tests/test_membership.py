"""Generations that cannot form are superseded by the agent; a waiting worker is not an agent loss.

A joiner stalls where it would build the gloo group of its first generation (EF_PROBE_STALL_BUILD):
it has arrived and heartbeats, but never connects, so the members' rendezvous times out. The agent must
supersede that generation while the joiner is still stalled (it does not wait for the joiner), and the job
must go on to the 1-worker parameters. Stopped (SIGSTOP) instead, the joiner is killed by the heartbeat
check, which supersedes the generation as well.
"""
import json
import os
import signal

import pytest

from harness import (Hold, assert_equivalent, events, finish, logged_step, run_cli, start, wait_for,
                     world_sizes)

TIMEOUT_S = 4


def _stalled(path):
    """The stalled joiner's record ({pid, generation}) once it is whole; None before."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize("how", ["stalled", "stopped"])
def test_generation_that_cannot_form_is_superseded(tmp_path, reference, how):
    run, hold, stall = tmp_path / "run", Hold(tmp_path / "hold"), tmp_path / "stall.json"
    pace = tmp_path / "pace"
    pace.touch()  # slow steps until the generation's fate is seen; then the job ends at full speed
    proc = start(run, "launcher.workers=2", "launcher.max_workers=3", f"elastic.timeout_s={TIMEOUT_S}",
                 "elastic.heartbeat_timeout_s=2",
                 env={"EF_PROBE_HOLD": str(hold.path), "EF_PROBE_SLEEP": "0.15", "EF_PROBE_PACE": str(pace),
                      "EF_PROBE_STALL_BUILD": f"2:120:{stall}"})  # until the test removes the file
    wait_for(lambda: logged_step(run) >= 8, 120, "step 8")
    with hold:
        # Returns once the 3-worker generation is published; it forms only after the hold.
        assert "3 workers" in run_cli(["scale", run, "--workers", 3, "--wait", 120], timeout=180, check=True).stdout
    stalled = wait_for(lambda: _stalled(stall), 60, "the joiner to reach its group build")
    if how == "stopped":
        os.kill(stalled["pid"], signal.SIGSTOP)
    wait_for(lambda: [e for e in events(run, "superseded") if e["generation"] == stalled["generation"]], 60,
             "the agent to supersede the generation")
    assert stall.is_file(), "the joiner's stall ended before the generation was superseded"
    stall.unlink()  # the agent did not wait for the joiner: let it go on (a stopped one was killed)
    if how == "stalled":
        # Alive, it waits out of the group and is let into a later generation.
        with hold:  # a generation of 3 published after the one that failed (workers.json can still show that one)
            wait_for(lambda: [e for e in events(run) if e["event"] == "generation" and len(e["members"]) == 3
                              and e["generation"] > stalled["generation"]], 60, "the stalled joiner to re-enter")
        # ... and training with it: lifted before, the pace lets the job end before that generation forms
        wait_for(lambda: 3 in world_sizes(run), 60, "a step with the re-entered joiner")
        # Let go after its generation was superseded, it went to the next one without building that group
        # (connecting to peers that had left, it would have retried until elastic.timeout_s)
        said = "".join(log.read_text() for log in (run / "logs").glob("worker-*.log"))
        assert f"generation {stalled['generation']} was superseded before this member built its group" in said
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "agent (job master) is gone" not in out
    assert_equivalent(run, reference)
    assert world_sizes(run)[-1] == (3 if how == "stalled" else 2)


def test_scale_says_when_the_job_ended_first(tmp_path):
    """A job that finishes before the new workers arrive: `scale` says so at once, not after --wait."""
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=2", "launcher.max_workers=4", "trainer.max_steps=150",
                 env={"EF_PROBE_SLEEP": "0.05", "EF_PROBE_SLOW_START": "2:60"})  # joiners arrive too late
    wait_for(lambda: logged_step(run) >= 3, 120, "step 3")
    out = run_cli(["scale", run, "--workers", 4, "--wait", 120], timeout=180)
    finish(proc)
    # exit 1 and the job's end, not exit 0 and "still changing after 120s": it saw the end, not its --wait
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the job ended (it finished training)" in out.stderr and "before reaching 4" in out.stderr


def test_only_a_member_declared_gone_ends_the_groups_collectives_not_one_that_retires():
    """The membership poller cuts a group's links (and aborts its NCCL communicator) when the newest generation
    declares one of its members gone; a member that only retires is missing from the newest generation too, but
    it hands its sharded state over on this group first, so the group must stay whole (NCCL's included: an abort
    there once failed every scale-down's hand-off over NCCL)."""
    from elasticflow.distributed.membership.membership import Membership

    class Group:
        members, generation, cut = [1, 2, 3], 4, False

        def __init__(self):
            self.calls = []

        def cut_links(self):
            self.calls.append("cut")

        def abort(self):
            self.calls.append("abort")

    def poll(newest):
        m = Membership.__new__(Membership)
        m.group, m._gone_read, m.latest_generation, m.nccl_device = Group(), 4, 5, "cuda:0"
        m.departed = {7}  # declared gone in an earlier generation
        m._generation = lambda store, g: newest
        m._abort_if_a_member_left(None)
        return m.group.calls, m.departed

    # 3 retires: the hand-off runs on this group, and a save's rank 0 still waits for 3's report
    assert poll({"members": [1, 2], "gone": []}) == ([], {7})
    # 3 died: cut (and abort) at once; a save's rank 0 stops waiting for its report (checkpoint/save.py)
    assert poll({"members": [1, 2], "gone": [3]}) == (["cut"], {3, 7})
