"""`elasticflow inject`: faults caused on purpose through the job's control channel (a drill of its recovery)."""
import time

import pytest

from elasticflow.cli import main
from elasticflow.train.slowdown import READ_S
from harness import (STEPS, Limit, assert_equivalent, events, finish, members, metrics, reap, run_cli, start,
                     wait_for)


def test_slow_then_kill_through_inject_ends_on_the_one_worker_model(tmp_path, reference):
    """One 3-worker run: a rank that does not exist is refused; --slow makes rank 1 sleep twice its compute time
    in each step (its event says so); --kill 1 SIGKILLs it and the two survivors end on the 1-worker model."""
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 10)
    proc = start(run, "launcher.workers=3", env={"EF_PROBE_LIMIT": str(limit.path)})
    try:
        wait_for(lambda: len(limit.held()) == 3, 120, "3 workers waiting at step 11", proc=proc)
        victim = members(run)[1]
        refused = run_cli(["inject", run, "--kill", 3])
        assert refused.returncode != 0 and "rank 3 does not exist" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) <= 2, refused.stderr  # the error and its hint

        said = run_cli(["inject", run, "--slow", 1, "--factor", 3], check=True).stdout
        assert f"worker {victim['worker_id']}, pid {victim['pid']}" in said and "3x" in said, said
        asked = events(run, "inject")[0]
        assert (asked["action"], asked["rank"], asked["pid"], asked["factor"]) == ("slow", 1, victim["pid"], 3.0)
        # The worker reads its record once every READ_S, at a step boundary: past this, its first one reads it.
        wait_for(lambda: time.time() > asked["time"] + READ_S, READ_S + 5, "the worker's next read")
        limit.allow(20)
        slowed = wait_for(lambda: events(run, "slowed"), 60, "the slowed worker's event", proc=proc)[0]
        assert (slowed["worker"], slowed["rank"], slowed["factor"]) == (victim["worker_id"], 1, 3.0)
        # both rounded to 6 decimals in the event: a compute of 0.4 ms is 0.000407, its sleep 0.000815, not 0.000814
        assert slowed["compute_s"] > 0 and slowed["sleep_s"] == pytest.approx(2 * slowed["compute_s"], rel=1e-3,
                                                                                abs=2e-6)

        wait_for(lambda: len(limit.held()) == 3, 120, "3 workers waiting at step 21", proc=proc)
        said = run_cli(["inject", run, "--kill", 1], check=True).stdout
        assert said.startswith(f"killed rank 1 (worker {victim['worker_id']}, pid {victim['pid']}"), said
        limit.lift()
        out = finish(proc)
    finally:
        if proc.poll() is None:
            reap(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(run, reference)
    assert [e["pid"] for e in events(run, "left")] == [victim["pid"]]
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[1] == 3 and world[STEPS] == 2


@pytest.mark.parametrize("args,says", [
    (["--bitflip", "0", "--bit", "40"], "--bit must be 0..31"),
    (["--kill", "0", "--tensor", "w1"], "--bit and --tensor go with --bitflip"),
    (["--kill", "0"], "no running agent"),
    (["--slow", "0"], "--slow needs --factor"),
    (["--kill", "0", "--factor", "2"], "--factor and --for go with --slow"),
])
def test_refusals_are_one_line_and_a_non_zero_exit(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exit_:
        main(["inject", str(tmp_path), *args])
    assert exit_.value.code not in (0, None)
    err = capsys.readouterr().err
    assert says in err, err


def test_the_agent_acts_only_on_a_request_signed_with_the_job_token_and_once():
    """A forged request (another token) or a replayed one gets no reply and causes nothing."""
    from types import SimpleNamespace

    from elasticflow.distributed import protocol
    from elasticflow.distributed.agent.inject import Injection, message, slow_key

    put, logged = {}, []
    worker = SimpleNamespace(id=4, pid=1234, host="here", node=None, proc=None,
                             describe=lambda rank: {"rank": rank, "worker_id": 4, "pid": 1234, "host": "here"})
    state = SimpleNamespace(token="t" * 32, job="job1", members=[worker], generation=2, put=put.__setitem__,
                            event=lambda kind, **f: logged.append(kind))
    injection = Injection(state)

    def request(token, nonce="n1", rank=0):
        at = time.time()
        return {"action": "slow", "rank": rank, "factor": 2.0, "for_s": 0.0, "nonce": nonce, "time": at,
                "mac": protocol.sign(token, message("job1", "slow", rank, 2.0, 0.0, nonce, at))}

    assert injection.act(request("x" * 32)) is None and not put and not logged  # another run's token
    assert injection.act(request(state.token))["worker_id"] == 4
    assert slow_key(4) in put and logged == ["inject"]
    assert injection.act(request(state.token)) is None and logged == ["inject"]  # its nonce was taken
    assert "rank 1 does not exist" in injection.act(request(state.token, "n2", rank=1))["reason"]
