"""Stragglers (elastic.straggler, train/balance.py): a worker slower than its peers is dealt fewer micro-batches,
the model stays the one worker's, and a persistent one is reported, or with evict cut out and replaced.

The slow worker is made slow for real: SIGSTOP/SIGCONT from outside the job, 15 ms stopped in every 20, while
every micro-batch burns CPU time (tests/models/digits_probe.py's EF_PROBE_SPIN), which a stopped process does
not make; or `elasticflow inject --slow`, which sleeps in its compute as a slow device would.
"""
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness import (assert_bitwise, assert_equivalent, events, finish, logged_step, members, metrics, reap, run_cli,
                     start, wait_for)

from elasticflow.data.order import deal, split_by_cost
from elasticflow.observability.plot import figure
from elasticflow.observability.status import status
from elasticflow.train.balance import WINDOW, Balance

MICRO = ["trainer.micro_batch_size=8"]  # 8 micro-batches a step: shares can move by one
SPIN = {"EF_PROBE_SPIN": "0.02"}


def _balance(mode="rebalance", factor=2.0, patience=3, micro=8, min_workers=1):
    b = Balance(SimpleNamespace(straggler=mode, straggler_factor=factor, straggler_patience=patience), micro, 64,
                min_workers)
    b.run_log = SimpleNamespace(event=lambda kind, **f: b.said.append((kind, f)))
    b.said = []
    return b


def _steps(b, times, n, generation=0, rank=0):
    out = []
    for step in range(n):
        b.costs_for(generation, len(times))
        out.append(b.observe(times, step, rank, [10, 11, 12]))
    return out


def test_shares_follow_speed_hold_still_under_noise_and_start_over_with_new_members():
    b = _balance()
    assert _steps(b, [0.01, 0.01, 0.04], WINDOW + 2) == [None] * (WINDOW + 2)  # rebalance never evicts
    costs = b.costs_for(0, 3)
    assert split_by_cost(8, costs) == [4, 3, 1]
    # Every micro-batch once, in order, whoever computes it
    dealt = [deal((0, 64), r, 3, 8, costs).micro for r in range(3)]
    assert [m for share in dealt for m in share] == [(a, a + 8) for a in range(0, 64, 8)]
    # One step held up (a page fault, a checkpoint) moves nothing: the estimate is a median
    _steps(b, [0.01, 0.5, 0.04], 1)
    assert b.costs_for(0, 3) is costs
    # New members: equal shares, measured again from scratch
    assert b.costs_for(1, 2) is None and b.estimate == [0.0, 0.0]
    # Equal speeds never move shares from equal
    b = _balance()
    _steps(b, [0.01, 0.0101, 0.0099], 3 * WINDOW)
    assert b.costs_for(0, 3) is None and not b.said


def test_a_straggler_is_reported_once_and_evicted_only_above_min_workers():
    b = _balance(mode="evict", patience=4)
    got = _steps(b, [0.01, 0.01, 0.05], 12)
    evicted = [r for r in got if r is not None]
    assert evicted == [2], got
    said = [f for kind, f in b.said if kind == "straggler"]
    assert len(said) == 1 and said[0]["worker"] == 12 and said[0]["action"] == "evict"
    assert said[0]["slowdown"] == pytest.approx(5.0)
    # Reported once while the members stay: a step under the factor between two slow stretches starts no episode
    b = _balance(patience=3)
    _steps(b, [0.01, 0.01, 0.05], 8)
    _steps(b, [0.01, 0.01, 0.01], 1)
    _steps(b, [0.01, 0.01, 0.05], 8)
    assert [f["rank"] for kind, f in b.said if kind == "straggler"] == [2]
    # Two members and launcher.min_workers=2: reported, never evicted below the minimum
    b = _balance(mode="evict", patience=2, min_workers=2)
    assert set(_steps(b, [0.01, 0.05], 10)) == {None}
    assert [f["action"] for kind, f in b.said if kind == "straggler"] == ["rebalance"]
    # Without trainer.micro_batch_size nothing moves: reported, with the hint
    b = _balance(micro=None, patience=2)
    _steps(b, [0.01, 0.01, 0.05], 10)
    assert b.costs_for(0, 3) is None
    assert [f["action"] for kind, f in b.said if kind == "straggler"] == ["report"]


# SIGSTOP PID 16 ms in every 20 until killed (then SIGCONT): a fifth of its speed. A process of its own at a higher
# priority than the job's: a thread of the test, on a loaded machine, overslept its 4 ms and let the victim run half
# the time.
DUTY_CYCLE = """
import os, signal, sys, time
pid = int(sys.argv[1])
os.nice(-10)
signal.signal(signal.SIGTERM, lambda *_: (os.kill(pid, signal.SIGCONT), sys.exit(0)))
while True:
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.016)
    os.kill(pid, signal.SIGCONT)
    time.sleep(0.004)
"""


def _duty_cycle(pid):
    return subprocess.Popen([sys.executable, "-c", DUTY_CYCLE, str(pid)])


def test_a_duty_cycled_worker_gets_fewer_micro_batches_and_the_bits_stay_the_one_workers(tmp_path, one_worker):
    """trainer.reproducible: the shares move (the straggler's to 1 of 8) and the model is the 1-worker run's bits."""
    settings = [*MICRO, "trainer.reproducible=true", "elastic.straggler_factor=1.5", "elastic.straggler_patience=8"]
    reference = one_worker(*settings, here=True)
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", *settings, env=SPIN)
    cycler = None
    try:
        wait_for(lambda: (run / "workers.json").exists() and len(members(run)) == 3, 120, "3 members", proc=proc)
        victim = members(run)[2]
        cycler = _duty_cycle(victim["pid"])
        out = finish(proc)
    finally:
        if cycler is not None:
            cycler.terminate()
            cycler.wait(5)
        if proc.poll() is None:
            reap(proc)
    assert proc.returncode == 0, out[-4000:]
    # Some shares dealt the victim fewer micro-batches than either other member (it starts at 8 = 3+3+2)
    moved = [e["shares"] for e in events(run, "rebalanced")]
    assert any(s[2] < min(s[0], s[1]) for s in moved), moved
    # The victim reported, once (a loaded machine may slow another member past the factor too: reported as well)
    said = [e for e in events(run, "straggler") if e["worker"] == victim["worker_id"]]
    assert [(e["rank"], e["action"]) for e in said] == [(2, "rebalance")], events(run, "straggler")
    assert "straggler: worker" in out and "shares by speed" in out
    assert_bitwise(run, reference)
    # status says who straggles and the shares in force; plot marks it on the loss curve at its step
    shown = status(run)
    assert f"straggler: worker {victim['worker_id']} (rank 2)" in shown and "shares by speed since step" in shown
    loss = next(ax for ax in figure(run).axes if ax.get_title() == "loss")
    marks = [li.get_xdata()[0] for li in loss.get_lines() if li.get_gid() == "mark:straggler"]
    assert said[0]["step"] in marks, marks


def test_a_worker_slowed_by_inject_is_evicted_and_replaced(tmp_path, one_worker):
    """elastic.straggler=evict: `inject --slow 1 --factor 5`; the members cut it out (its exit says why), the agent
    starts a replacement, and the job ends on the 1-worker model."""
    reference = one_worker(*MICRO, "trainer.max_steps=100", here=True)
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", "launcher.restart_failed=true", *MICRO, "elastic.straggler=evict",
                 "elastic.straggler_patience=5", "trainer.max_steps=100", env=SPIN)
    try:
        wait_for(lambda: logged_step(run) >= 5, 120, "step 5", proc=proc)
        victim = members(run)[1]
        run_cli(["inject", run, "--slow", 1, "--factor", 5], check=True)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            reap(proc)
    assert proc.returncode == 0, out[-4000:]
    said = events(run, "straggler")
    assert [(e["worker"], e["action"]) for e in said] == [(victim["worker_id"], "evict")], said
    left = events(run, "left")
    assert [(e["worker"], e["cause"]) for e in left] == [(victim["worker_id"], "evicted: a straggler")], left
    assert events(run, "restart")[0]["replacing"] == victim["worker_id"]
    world = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert world[0] == 3 and 2 in world and world[-1] == 3, world
    assert not (run / "error.json").exists()
    assert_equivalent(run, reference)
