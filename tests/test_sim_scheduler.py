"""scripts/sim/sim_scheduler.py: gang against elastic scheduling on a simulated cluster (docs/elastic-scheduling.md).

A hand-made trace whose answer is worked out below, the invariants on a random trace (and that the check
catches a broken run), the costs read from a goodput ledger, and the command line's errors.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "sim"))
import sim_scheduler as sim  # noqa: E402
from sim_trace import Costs, InputError, Job, read_costs, synthetic  # noqa: E402

SCRIPT = REPO / "scripts" / "sim" / "sim_scheduler.py"
LEDGER = REPO / "docs" / "benchmarks" / "elastic-costs-goodput.json"
COSTS = Costs(join=1.0, scale_down=0.5, failure=0.0, source="test")


def hand_trace():
    """A cluster of 4: A needs 4 workers for 10 s from t=0; B arrives at t=1 needing 4 for 10 s. Elastic, each
    runs on 2..4."""
    return [Job(0, 0.0, 4, 2, 10.0), Job(1, 1.0, 4, 2, 10.0)]


@pytest.mark.parametrize("policy", ["gang-fifo", "gang-backfill"])
def test_gang_b_waits_until_all_of_a_ends(policy):
    a, b = sim.simulate(hand_trace(), 4, policy, COSTS)
    assert (a.start, a.end) == (0.0, 10.0)
    assert b.start - b.job.arrival == 9.0 and b.end == 20.0
    s = sim.summary([a, b], 4)
    assert (s["joins"], s["downs"], s["lost_ws"], s["productive"]) == (0, 0, 0.0, 1.0)


def test_elastic_b_starts_on_arrival_and_the_changes_are_charged():
    a, b = sim.simulate(hand_trace(), 4, "elastic", COSTS)
    # t=1: A (4 of its 40 worker-seconds done) shrinks to 2 so that B starts on 2: no wait at all.
    assert b.start == 1.0
    # A's scale-down stops it 0.5 s; 36 worker-seconds left on 2 workers: 1 + 0.5 + 18 = 19.5.
    assert a.charges == [(1.0, 0.5)] and a.alloc[:2] == [(0.0, 4), (1.0, 2)]
    assert a.end == pytest.approx(19.5)
    # B did 2 x 18.5 = 37 by then and grows to 4 (a join: 1 s), then 3 left on 4 workers: 19.5 + 1 + 0.75.
    assert b.alloc[:2] == [(1.0, 2), (pytest.approx(19.5), 4)] and b.charges == [(pytest.approx(19.5), 1.0)]
    assert b.end == pytest.approx(21.25)
    s = sim.summary([a, b], 4)
    assert (s["joins"], s["downs"]) == (1, 1)
    assert s["lost_ws"] == pytest.approx(0.5 * 2 + 1.0 * 4)  # each stall keeps that job's workers busy
    assert s["pending_mean"] == 0.0
    free = sim.simulate(hand_trace(), 4, "elastic", Costs(0.0, 0.0, 0.0, "free"))
    assert [r.end for r in free] == [pytest.approx(19.0), pytest.approx(20.0)]


def random_runs():
    trace, _ = synthetic(jobs=300, load=0.9, cluster=16, seed=3)
    return trace, {p: sim.simulate(trace, 16, p, COSTS) for p in sim.POLICIES}


def test_invariants_hold_on_a_random_trace_and_the_check_catches_a_broken_run():
    trace, runs = random_runs()
    for policy, records in runs.items():
        sim.check(records, 16, policy)
        assert len(records) == len(trace) and all(r.end > r.start >= r.job.arrival for r in records)
    elastic = runs["elastic"]
    assert sim.summary(elastic, 16)["joins"] > 0 and sim.summary(elastic, 16)["downs"] > 0
    # A 16-worker job run twice at once: each run is sound alone, together they need 32 workers of 16.
    twice = runs["gang-fifo"] + [copy.deepcopy(next(r for r in runs["gang-fifo"] if r.job.workers == 16))]
    with pytest.raises(sim.InvariantError, match="workers busy at t="):
        sim.check(twice, 16, "gang-fifo")
    # More work done than the job had: kept its workers when it was shrunk, or a change not paid for.
    crowded, free_lunch = copy.deepcopy(elastic), copy.deepcopy(elastic)
    shrunk = next(r for r in crowded if r.downs)
    shrunk.alloc = [(t, n and shrunk.job.workers) for t, n in shrunk.alloc]
    next(r for r in free_lunch if r.charges).charges.pop()
    for broken in (crowded, free_lunch):
        with pytest.raises(sim.InvariantError, match="worker-seconds of work"):
            sim.check(broken, 16, "elastic")


def test_elastic_with_min_equal_to_max_is_gang_fifo():
    trace = [Job(j.id, j.arrival, j.workers, j.workers, j.duration) for j in random_runs()[0]]
    gang, elastic = (sim.simulate(trace, 16, p, COSTS) for p in ("gang-fifo", "elastic"))
    assert [(r.start, r.end) for r in elastic] == [(r.start, r.end) for r in gang]


def test_the_same_seed_gives_the_same_report(capsys):
    args = ["--goodput", str(LEDGER), "--jobs", "80", "--cluster", "16", "--seed", "5"]
    outputs = []
    for _ in range(2):
        assert sim.main(args) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "| pending time, mean |" in outputs[0]
    assert sim.main(args[:-1] + ["6"]) == 0
    assert capsys.readouterr().out != outputs[0]


def ledger(tmp_path, events=None, **changes):
    led = {"seconds": {"regroup": 0.5, "redone": 0.1, "detection": 0.2, "rebuild": 0.05, "transfer": 0.05},
           "regroups": 3, "recoveries": 2, **changes}
    (tmp_path / "goodput.json").write_text(json.dumps(led))
    if events is not None:
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn')
    return tmp_path / "goodput.json"


def regrouped(before, after, seconds):
    return {"event": "regrouped", "previous_world_size": before, "world_size": after, "recovery_s": seconds}


def test_costs_are_the_ledgers_seconds_over_the_number_of_each_change(tmp_path):
    events = [regrouped(2, 3, 0.1), regrouped(3, 2, 0.3), regrouped(2, 4, 0.1),
              {"event": "recovered", "recovery_s": 0.02}, {"event": "recovered", "recovery_s": 0.08}]
    costs = read_costs(ledger(tmp_path, events))
    assert (costs.join, costs.scale_down, costs.failure) == pytest.approx((0.1, 0.3, 0.2))
    (tmp_path / "events.jsonl").unlink()
    costs = read_costs(tmp_path / "goodput.json")  # no events: joins and scale-downs not told apart
    assert (costs.join, costs.scale_down) == pytest.approx((0.5 / 3, 0.5 / 3))
    with pytest.raises(InputError, match="the ledger has 3"):
        read_costs(ledger(tmp_path, events[:2]))


def test_the_recorded_runs_costs():
    """docs/elastic-scheduling.md quotes these: the recorded run's 3 joins, 2 scale-downs and 2 failures."""
    costs = read_costs(LEDGER)
    assert costs.join == pytest.approx((0.0333 + 0.0356 + 0.0364) / 3)
    assert costs.scale_down == pytest.approx((0.0437 + 0.0368) / 2)
    assert costs.failure == pytest.approx(0.1473 / 2)


def test_a_bad_goodput_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "goodput.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--goodput", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: --goodput {bad}: not a goodput ledger")
    no_change = {"seconds": dict.fromkeys(("regroup", "redone", "detection", "rebuild", "transfer"), 0.0),
                 "regroups": 0, "recoveries": 0}
    for text in ('{"seconds": {}}', json.dumps(no_change)):
        bad.write_text(text)
        assert sim.main(["--goodput", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --goodput") and "RUN_DIR/goodput.json" in err
    assert sim.main(["--goodput", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_the_command_prints_both_policies_and_writes_the_plot(tmp_path):
    png = tmp_path / "sim.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--goodput", str(LEDGER), "--jobs", "60", "--cluster", "16",
                           "--plot", str(png), "--repeat", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| | gang FIFO | gang backfill | elastic |" in proc.stdout
    assert "elastic / gang FIFO: pending time mean" in proc.stdout and "| median |" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
