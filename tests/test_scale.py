"""Scale-up, scale-down, restarts, hang detection and the closed rendezvous, on real processes.

Training is held still where the test needs it (EF_PROBE_HOLD: forward waits while a file exists),
so a scale or a kill lands at a known point even on a loaded 2-core machine. A hold longer than
elastic.timeout_s looks exactly like a hung worker (its peer waits in a collective), so tests that
hold use HOLD_TIMEOUT.
"""
import json
import os
import re
import signal
import socket
import stat
import subprocess
import threading

import pytest

from harness import (ELASTICFLOW, PROBE, Hold, Limit, assert_each_sample_once, assert_equivalent, cli, events, finish,
                     logged_step, members, reap, run_cli, scale, start, wait_for, world_sizes)

from elasticflow.observability import status as run_status
from elasticflow.distributed import protocol
from elasticflow.distributed.agent import control, scaling
from elasticflow.distributed.membership.membership import Membership
from elasticflow.distributed.store.listen import listening_store


HOLD_TIMEOUT = ["elastic.timeout_s=90", "elastic.heartbeat_timeout_s=10"]


def both_admitted(snapshot: dict) -> bool:
    """Four workers, each a member or admitted (none still starting): an empty `joining` alone proves nothing."""
    joining = snapshot["joining"]
    return len(snapshot["members"]) + len(joining) == 4 and all(w["state"] == "admitted" for w in joining)


def test_grow_kill_shrink_matches_single_worker_and_uses_every_sample_once(tmp_path, reference):
    run, record, hold = tmp_path / "run", tmp_path / "record", Hold(tmp_path / "hold")
    record.mkdir()
    proc = start(run, "launcher.workers=2", "trainer.micro_batch_size=16", *HOLD_TIMEOUT,
                 env={"EF_PROBE_HOLD": str(hold.path), "EF_PROBE_RECORD": str(record), "EF_PROBE_SLEEP": "0.01"})
    wait_for(lambda: logged_step(run) >= 14, 120, "step 14")
    with hold:
        scale(run, 4, wait=0)
        # Joiners admitted while a generation forms enter the next one: the second waits for the first's
        # generation, which forms only once the members leave the hold.
        wait_for(lambda: both_admitted(json.loads((run / "workers.json").read_text())), 120, "both joiners admitted")
    wait_for(lambda: len(members(run)) == 4, 60, "the 4-worker generation")
    wait_for(lambda: logged_step(run) >= 30, 120, "step 30")
    with hold:
        victim = members(run)[2]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: len(members(run)) == 3, 30, "the generation after the kill")
    wait_for(lambda: logged_step(run) >= 45, 120, "step 45")
    with hold:
        scale(run, 2, wait=0)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(run, reference)
    sizes = world_sizes(run)
    assert sizes[0] == 2 and 4 in sizes and 3 in sizes and sizes[-1] == 2
    assert_each_sample_once(run, record)  # every sample of an epoch in exactly one committed step
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("joined") == 2 and kinds.count("retired") == 1 and kinds.count("left") == 1
    joined = [e for e in events(run) if e["event"] == "joined"]
    assert all(e["state_received"] for e in joined)  # joiners got the full state by broadcast
    # The console says each change in plain words, once (issue 68): who, with its pid, at which step, how many now.
    # the joiners enter one generation, or two in a row (the second admitted while the first's formed)
    said = {rf"worker {e['worker']} \(pid \d+\)[^:;\n]* joined at step \d+: [34] workers" for e in joined}
    said.add(rf"worker {victim['worker_id']} \(pid {victim['pid']}\) died at step \d+ \(signal SIGKILL\): "
             r"(continuing with )?3 workers")
    retired = next(e for e in events(run) if e["event"] == "retired")
    said.add(rf"worker {retired['worker']} \(pid {retired['pid']}\) retired at step \d+: 2 workers")
    lines = [line for line in out.splitlines() if line.startswith("worker ")]
    assert [line for line in said if len(re.findall(line, out)) != 1] == [], lines


def test_a_one_worker_run_started_growable_grows_to_three_and_ends_on_the_one_worker_model(tmp_path, reference):
    """launcher.max_workers makes a 1-worker run an agent's job (not trained in-process), so `elasticflow scale`
    can grow it; the grown run ends on the 1-worker model."""
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 10)
    proc = start(run, "launcher.max_workers=3", env={"EF_PROBE_LIMIT": str(limit.path)})
    wait_for(lambda: logged_step(run) >= 5, 120, "step 5", proc=proc)
    scale(run, 3, wait=0)
    limit.advance_until(run, lambda: 3 in world_sizes(run), 120, "a step with 3 workers")
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    sizes = world_sizes(run)
    assert sizes[0] == 1 and sizes[-1] == 3, sizes
    assert_equivalent(run, reference)


def test_sigstopped_worker_is_cut_out_by_its_silent_heartbeat(tmp_path, reference):
    """A stopped worker is cut out by the heartbeat check (elastic.heartbeat_timeout_s), not found only when
    its peers' collective times out (elastic.timeout_s): the agent's reason says which."""
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", "elastic.timeout_s=6", "elastic.heartbeat_timeout_s=2",
                 env={"EF_PROBE_SLEEP": "0.03"})
    wait_for(lambda: logged_step(run) >= 10, 120, "step 10")
    victim = members(run)[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    hung = events(run, "hung")
    assert [e["pid"] for e in hung] == [victim["pid"]]
    assert hung[0]["reason"].startswith("no heartbeat for"), hung
    assert_equivalent(run, reference)


def test_a_stopped_retiring_worker_is_cut_out_not_waited_for(tmp_path, reference):
    """A worker retired by a scale-down stays in the current group until the step boundary, and its peers'
    allreduce waits for it. Stopped there, the agent must cut it out after the heartbeat timeout, as it
    does members, not leave the peers waiting elastic.timeout_s (found by scripts/soak/chaos.py)."""
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 10)
    proc = start(run, "launcher.workers=3", "elastic.timeout_s=60", "elastic.heartbeat_timeout_s=2",
                 env={"EF_PROBE_LIMIT": str(limit.path), "EF_PROBE_SLEEP": "0.01"})
    # All three waiting in step 11's forward (a worker past a forward would meet the new generation at that
    # step's boundary, and the retiree would leave there before the stop: CI, no `hung` event).
    wait_for(lambda: len(limit.held()) == 3, 120, "every worker at the limit", proc=proc)
    scale(run, 2, wait=0)
    retiring = json.loads((run / "workers.json").read_text())["retiring"]
    assert len(retiring) == 1, retiring
    victim = retiring[0]["pid"]
    os.kill(victim, signal.SIGSTOP)  # at the limit: its peers will wait for it in the step's allreduce
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    hung = events(run, "hung")
    assert [e["pid"] for e in hung] == [victim]
    # cut out by its silent heartbeat (heartbeat_timeout_s), not after the peers' collective timed out
    assert hung[0]["reason"].startswith("no heartbeat for"), hung
    assert world_sizes(run)[-1] == 2
    assert_equivalent(run, reference)


def test_a_joiner_that_died_halfway_does_not_block_later_joins(tmp_path, reference):
    """A joiner counts itself (join/count) and then writes its request: killed in between, its request
    never comes. The agent used to read requests strictly in order, so every later join waited for it
    forever. Here the count is taken exactly as such a joiner would, then a real one is asked for."""
    from elasticflow.distributed.store.stores import connect

    run, pace = tmp_path / "run", tmp_path / "pace"
    pace.touch()  # slow steps until the real join is in
    proc = start(run, "launcher.workers=2", "launcher.max_workers=3",
                 env={"EF_PROBE_SLEEP": "0.25", "EF_PROBE_PACE": str(pace)})
    wait_for(lambda: logged_step(run) >= 3, 120, "step 3")
    connect(json.loads(protocol.agent_file(run).read_text())["address"], 30).add("join/count", 1)  # half-done
    out = scale(run, 3, wait=60).stdout
    assert "reached: generation" in out and "has 3 workers" in out, out
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert world_sizes(run)[-1] == 3
    assert_equivalent(run, reference)


@pytest.mark.parametrize("max_restarts,replaced", [(3, 3), (2, 2)])
def test_restart_failed_replaces_dead_workers_up_to_max_restarts(tmp_path, reference, max_restarts, replaced):
    run, hold = tmp_path / "run", Hold(tmp_path / "hold")
    limit = Limit(tmp_path / "limit", 10)  # the job cannot end before the last replacement is in (CI: it did)
    proc = start(run, "launcher.workers=2", "launcher.restart_failed=true", f"launcher.max_restarts={max_restarts}",
                 *HOLD_TIMEOUT,
                 env={"EF_PROBE_HOLD": str(hold.path), "EF_PROBE_LIMIT": str(limit.path), "EF_PROBE_SLEEP": "0.01"})
    for i, at_step in enumerate((10, 25, 40)):
        limit.allow(at_step)
        wait_for(lambda: logged_step(run) >= at_step - 1, 120, f"step {at_step - 1}", proc=proc)
        with hold:
            victim = members(run)[-1]
            os.kill(victim["pid"], signal.SIGKILL)
            # The survivor is held, so the generation without the victim cannot form yet; the replacement
            # is admitted meanwhile and enters the generation after it, once the hold ends.
            wait_for(lambda: len(members(run)) == 1, 30, "the generation without the victim", proc=proc)
            if i < replaced:
                wait_for(lambda: len(members(run)) == 2 or any(
                    w["state"] == "admitted" for w in json.loads((run / "workers.json").read_text())["joining"]), 120,
                    "the replacement to be admitted", proc=proc)
        if i < replaced:
            limit.advance_until(run, lambda: len(members(run)) == 2, 120, "the replacement to join")
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("restart") == replaced and kinds.count("left") == 3
    assert ("restart_refused" in kinds) == (replaced < 3)
    assert world_sizes(run)[-1] == (2 if replaced == 3 else 1)
    assert_equivalent(run, reference)


def test_strangers_without_the_token_are_refused(tmp_path, reference):
    run, hold = tmp_path / "run", Hold(tmp_path / "hold")
    proc = start(run, "launcher.workers=2", *HOLD_TIMEOUT, env={"EF_PROBE_HOLD": str(hold.path)})
    wait_for(lambda: logged_step(run) >= 5, 120, "step 5")
    token_file = run / ".elasticflow" / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    address = json.loads((run / ".elasticflow" / "agent.json").read_text())["address"]
    with hold:
        strangers = []  # both at once: each is refused on its own
        for token in ("not-the-token", None):
            env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICFLOW_")}
            env.update({protocol.ENV_STORE: address, protocol.ENV_RUN_DIR: str(run)})
            if token:
                env[protocol.ENV_TOKEN] = token
            strangers.append(subprocess.Popen(ELASTICFLOW[:1] + ["-m", "elasticflow.launchers.worker"], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        try:
            errs = [stranger.communicate(timeout=120)[1] for stranger in strangers]
        finally:
            for stranger in strangers:
                if stranger.poll() is None:
                    reap(stranger)
        for stranger, err in zip(strangers, errs):
            assert stranger.returncode == 6, err[-2000:]
            assert "refused" in err and "token" in err
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    refused = [e for e in events(run) if e["event"] == "refused"]
    assert len(refused) == 2 and all("token" in e["reason"] for e in refused)
    assert set(world_sizes(run)) == {2}  # training was not disturbed
    assert_equivalent(run, reference)


def test_status_and_scale_errors(tmp_path):
    run, hold = tmp_path / "run", Hold(tmp_path / "hold")
    proc = start(run, "launcher.workers=2", "launcher.max_workers=3", *HOLD_TIMEOUT,
                 env={"EF_PROBE_HOLD": str(hold.path)})
    wait_for(lambda: logged_step(run) >= 3, 120, "step 3")
    with hold:
        out = run_cli(["status", run], check=True).stdout
        assert "running" in out and "generation 0" in out and "samples consumed" in out
        for m in members(run):
            assert str(m["pid"]) in out
        # What the trainer reports once it has chosen its device, through a real Membership of worker 1.
        reporter = Membership(json.loads(protocol.agent_file(run).read_text())["address"], 1, 10.0, 30.0, None)
        reporter.report_device("cuda:1 (NVIDIA A100), bf16 mixed, nccl")
        reporter.close()
        rank = next(m["rank"] for m in members(run) if m["worker_id"] == 1)
        out = run_cli(["status", run], check=True).stdout
        assert f"  worker 1: rank {rank}, cuda:1 (NVIDIA A100), bf16 mixed, nccl" in out.splitlines(), out
        too_many = cli(["scale", run, "--workers", "5"])
        assert too_many.returncode != 0 and "launcher.max_workers=3" in too_many.stderr
    finish(proc)
    assert proc.returncode == 0
    assert "not running" in run_cli(["status", run], check=True).stdout
    gone = cli(["scale", run, "--workers", "2"])
    assert gone.returncode == 2 and "no running agent" in gone.stderr and "Traceback" not in gone.stderr


def test_status_shows_the_devices_reported_and_nothing_for_the_others(tmp_path):
    store, listener = listening_store("127.0.0.1", 5.0)
    try:
        (tmp_path / ".elasticflow").mkdir()
        protocol.agent_file(tmp_path).write_text(json.dumps({"address": f"127.0.0.1:{store.port}", "pid": 1}))
        worker = {"pid": 100, "host": "node1", "state": "training"}
        (tmp_path / "workers.json").write_text(json.dumps({
            "generation": 2, "members": [{"rank": 0, "worker_id": 4, **worker}, {"rank": 1, "worker_id": 2, **worker}],
            "joining": [{"worker_id": 5, "pid": 101, "host": "node1", "state": "joining"}], "retiring": []}))
        store.set(protocol.device_key(2), "cuda:1 (NVIDIA A100), bf16 mixed, nccl")
        store.set(protocol.device_key(5), "cuda:0 (NVIDIA A100), bf16 mixed, nccl")
        lines = run_status.status(tmp_path).splitlines()
        assert lines[lines.index("devices:") + 1:][:2] == ["  worker 2: rank 1, cuda:1 (NVIDIA A100), bf16 mixed, nccl",
                                                           "  worker 5: joining, cuda:0 (NVIDIA A100), bf16 mixed, nccl"]
        assert not any("worker 4:" in line for line in lines)  # worker 4 has not reported (yet)
    finally:
        listener.close()
    # An agent file left by an agent that died: status answers all the same, without devices.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    protocol.agent_file(tmp_path).write_text(json.dumps({"address": f"127.0.0.1:{dead.getsockname()[1]}", "pid": 1}))
    dead.close()
    out = run_status.status(tmp_path)
    assert "devices:" not in out and "generation 2  workers 2" in out


def test_two_scale_commands_at_once_both_get_an_answer(tmp_path, monkeypatch):
    """Both requests are written before the agent reads either: each in its own numbered slot, so neither
    overwrites the other (whose client would then wait 30 s for a reply and fail)."""
    from omegaconf import OmegaConf

    store, listener = listening_store("127.0.0.1", 5.0)
    token = protocol.new_token(tmp_path)
    protocol.agent_file(tmp_path).write_text(json.dumps({"address": f"127.0.0.1:{store.port}", "pid": 1,
                                                         "job": "job1"}))
    (tmp_path / "workers.json").write_text(json.dumps({"generation": 0, "members": [{}, {}], "joining": [],
                                                       "retiring": []}))
    seen = []
    state = type("StubState", (), {  # just what Scaling.rescale reads when the target is the current size
        "store": store, "token": token, "cfg": OmegaConf.create({"launcher": {"min_workers": 1, "max_workers": 4}}),
        "event": lambda self, kind, **f: seen.append(f["requested"]), "target_workers": lambda self: 2,
        "generation": 0, "job": "job1", "verdicts": protocol.Sealer(token)})()
    agent = scaling.Scaling(state, spawn=None)
    monkeypatch.setattr(scaling.workers_json, "write", lambda state: None)
    results = []
    clients = [threading.Thread(target=lambda: results.append(control.scale(tmp_path, 2, wait_s=0)), daemon=True)
               for _ in range(2)]
    try:
        for c in clients:
            c.start()
        wait_for(lambda: store.check(["control/request/1", "control/request/2"]), 30, "both clients' requests")
        wait_for(lambda: (agent.serve(), len(seen) == 2)[1], 10, "the agent to answer both", every=0.01)
        for c in clients:
            c.join(40)
    finally:
        listener.close()
    assert seen == [2, 2] and results == ["reached: generation 0 has 2 workers"] * 2


def test_heartbeat_longer_than_collective_timeout_is_refused(tmp_path):
    proc = cli(["train", PROBE, f"hydra.run.dir={tmp_path}", "elastic.heartbeat_timeout_s=60", "elastic.timeout_s=30"])
    assert proc.returncode == 2
    assert "elastic.heartbeat_timeout_s=60 must be positive and shorter than elastic.timeout_s=30" in proc.stderr


def test_tensorflow_join_matches_single_worker(tmp_path, tf_reference):
    """A TF joiner gets the state by broadcast and the run ends on the 1-worker model. One worker grown to two,
    not two to three: each TF worker spends seconds importing TensorFlow, and joins into a group of several are
    the torch tests' above (the same membership code on either backend)."""
    run, hold, record = tmp_path / "run", Hold(tmp_path / "hold"), tmp_path / "record"
    record.mkdir()
    proc = start(run, "backend=tensorflow", "launcher.workers=1", "launcher.max_workers=2", *HOLD_TIMEOUT,
                 env={"EF_PROBE_HOLD": str(hold.path), "EF_PROBE_RECORD": str(record)})
    wait_for(lambda: logged_step(run) >= 15, 180, "step 15", proc=proc)
    with hold:
        scale(run, 2)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert world_sizes(run)[0] == 1 and world_sizes(run)[-1] == 2
    joined = [e for e in events(run) if e["event"] == "joined"]
    assert len(joined) == 1 and joined[0]["state_received"]
    assert_equivalent(run, tf_reference)
