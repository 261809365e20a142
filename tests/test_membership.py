"""Generations that cannot form are superseded by the agent; a waiting worker is not an agent loss.

A joiner stalls where it would build the gloo group of its first generation (EF_PROBE_STALL_BUILD):
it has arrived and heartbeats, but never connects, so the members' rendezvous times out. The agent
must publish the next generation within elastic.timeout_s + 1 s of the stall, and the job must go on
to the 1-worker parameters. Stopped (SIGSTOP) instead, the joiner is killed by the heartbeat check,
which supersedes the generation as well.
"""
import json
import os
import signal
import time

import pytest

from conftest import run_cli
from test_elastic import (assert_equivalent, events, finish, logged_step, members, reference, start,  # noqa: F401
                          wait_for)
from test_scale import Hold

TIMEOUT_S = 4


@pytest.mark.parametrize("how", ["stalled", "stopped"])
def test_generation_that_cannot_form_is_superseded(tmp_path, reference, how):
    run, hold, stall = tmp_path / "run", Hold(tmp_path / "hold"), tmp_path / "stall.json"
    pace = tmp_path / "pace"
    pace.touch()  # slow steps until the generation's fate is seen; then the job ends at full speed
    proc = start(run, "launcher.workers=2", "launcher.max_workers=3", f"elastic.timeout_s={TIMEOUT_S}",
                 "elastic.heartbeat_timeout_s=2",
                 env={"EF_PROBE_HOLD": str(hold.path), "EF_PROBE_SLEEP": "0.15", "EF_PROBE_PACE": str(pace),
                      "EF_PROBE_STALL_BUILD": f"2:{TIMEOUT_S + 2}:{stall}"})
    wait_for(lambda: logged_step(run) >= 8, 120, "step 8")
    with hold:
        # Returns once the 3-worker generation is published; it forms only after the hold.
        assert "3 workers" in run_cli(["scale", run, "--workers", 3, "--wait", 120], timeout=180, check=True).stdout
    wait_for(stall.is_file, 60, "the joiner to reach its group build")
    stalled = json.loads(stall.read_text())
    if how == "stopped":
        os.kill(stalled["pid"], signal.SIGSTOP)
    superseded = wait_for(lambda: [e for e in events(run) if e["event"] == "superseded"
                                   and e["generation"] == stalled["generation"]], TIMEOUT_S + 10,
                          "the agent to supersede the generation")
    assert superseded[0]["time"] - stalled["time"] <= TIMEOUT_S + 1, superseded
    if how == "stalled":
        # Alive, it waits out of the group and is let into a later generation.
        with hold:  # a generation of 3 published after the one that failed (workers.json can still show that one)
            wait_for(lambda: [e for e in events(run) if e["event"] == "generation" and len(e["members"]) == 3
                              and e["generation"] > stalled["generation"]], 60, "the stalled joiner to re-enter")
        # ... and training with it: lifted before, the pace lets the job end before that generation forms
        wait_for(lambda: any(r.get("world_size") == 3 for r in json_lines(run / "metrics.jsonl") if "loss" in r),
                 60, "a step with the re-entered joiner")
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "agent (job master) is gone" not in out
    assert_equivalent(run, reference)
    world = [r["world_size"] for r in json_lines(run / "metrics.jsonl") if "loss" in r]
    assert world[-1] == (3 if how == "stalled" else 2)


def json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_scale_says_when_the_job_ended_first(tmp_path):
    """A job that finishes before the new workers arrive: `scale` says so at once, not after --wait."""
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=2", "launcher.max_workers=4", "trainer.max_steps=150",
                 env={"EF_PROBE_SLEEP": "0.05", "EF_PROBE_SLOW_START": "2:60"})  # joiners arrive too late
    wait_for(lambda: logged_step(run) >= 3, 120, "step 3")
    began = time.monotonic()
    out = run_cli(["scale", run, "--workers", 4, "--wait", 120], timeout=180)
    finish(proc)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the job ended (it finished training)" in out.stderr and "before reaching 4" in out.stderr
    assert time.monotonic() - began < 60
