"""Rank 0's step records (reporting.StepLog): when each record reaches metrics.jsonl, and what a new rank 0
writes for the one that left. tests/test_elastic.py's rank0-before-writing-a-record kills a real rank 0 at
the point these cover."""
import json

from elasticflow.observability.reporting import RunLog, StepLog

from harness import PROBE, metrics, train


def record(step: int, samples_per_step: int = 64) -> dict:
    return {"step": step, "epoch": 0, "loss": 1.0 / step, "lr": 0.1, "samples_seen": step * samples_per_step,
            "world_size": 2, "generation": 0, "micro_step": step, "global_batch": samples_per_step,
            "time": 1000.0 + step, "step_time_s": 0.001}


def written(run_dir) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def step_log(run_dir, log_every: int = 1, total_steps: int = 100) -> StepLog:
    log = StepLog(RunLog(run_dir), log_every, lambda: {"0": 1.0})
    log.total_steps = total_steps
    return log


def test_one_worker_writes_at_once_several_at_the_next_flush(tmp_path):
    one = step_log(tmp_path / "one")
    one.ended(record(1), rank=0, world=1)
    assert written(tmp_path / "one") == [1]

    two = step_log(tmp_path / "two")
    two.ended(record(1), rank=0, world=2)
    assert written(tmp_path / "two") == []  # kept for the next reduction
    two.flush()
    two.flush()  # nothing left to write
    assert written(tmp_path / "two") == [1]

    other = step_log(tmp_path / "other")
    other.ended(record(1), rank=1, world=2)
    other.flush()
    assert written(tmp_path / "other") == []  # only rank 0 writes


def test_log_every_and_the_last_step(tmp_path):
    log = step_log(tmp_path, log_every=10, total_steps=25)
    for step in range(1, 26):
        log.ended(record(step), rank=0, world=1)
    assert written(tmp_path) == [10, 20, 25]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["memory_mib"] == {"0": 1.0}


def test_a_new_rank_0_writes_what_the_old_one_did_not(tmp_path):
    """The old rank 0 wrote step 19 and died before writing 20; the others committed 20 and 21."""
    old = step_log(tmp_path)
    for step in range(1, 20):
        old.ended(record(step), rank=0, world=1)
    new = step_log(tmp_path)
    for step in (19, 20, 21):
        new.committed(record(step))
    new.run_log.take_over()
    new.rewrite(record(21))
    assert written(tmp_path) == list(range(1, 22))


def test_a_rolled_forward_rank_0_writes_its_own_step_and_the_adopted_one(tmp_path):
    """The new rank 0 committed only step 20; a member that committed 21 gave it its state (rolled forward)."""
    old = step_log(tmp_path)
    for step in range(1, 20):
        old.ended(record(step), rank=0, world=1)
    new = step_log(tmp_path)
    for step in (19, 20):
        new.committed(record(step))
    new.run_log.take_over()
    new.rewrite(record(21))
    new.rewrite(record(21))  # a second regroup before the next step: nothing twice
    assert written(tmp_path) == list(range(1, 22))


def test_the_banner_says_how_a_global_batch_is_cut_and_dealt():
    """It said "global batch 64 = micro 16 x accumulation 2 x workers 3" (that is 96): the deal was 2+1+1."""
    from elasticflow.observability.reporting import banner, batch_layout

    assert batch_layout(64, 3, 16) == "4 micro-batches of 16, dealt 2+1+1 over 3 workers"
    assert batch_layout(64, 3, 24) == "3 micro-batches of 24 (the last 16), dealt 1+1+1 over 3 workers"
    assert batch_layout(64, 3, None) == "22+21+21 samples over 3 workers, one micro-batch per worker"
    assert batch_layout(64, 1, None) == "1 micro-batch of 64" and batch_layout(64, 1, 16) == "4 micro-batches of 16"
    assert batch_layout(64, 5, 64) == "1 micro-batch of 64, dealt 1+0+0+0+0 over 5 workers"
    assert batch_layout(64, 12, 4) == "16 micro-batches of 4, dealt 1-2 each over 12 workers"
    first = banner(backend="torch", device="cpu", world=3, global_batch=64, micro=16, optimizer="sgd", samples=640,
                   steps_per_epoch=10, total_steps=None, run_dir="r", resumed=None).splitlines()[0]
    assert first.endswith("| workers 3 | global batch 64 = 4 micro-batches of 16, dealt 2+1+1 over 3 workers")


def test_the_step_line_shows_the_intervals_mean_not_one_steps_time(tmp_path):
    """Steps 11-20 hold a 1 s pause (at step 15): the line for step 20 shows the mean over steps 11-20 (at least
    100 ms/step), not step 20's own time; the first line has no interval and shows its step's own."""
    run = tmp_path / "run"
    proc = train(PROBE, run, "trainer.max_steps=20", "trainer.log_every=10", env={"EF_PROBE_PAUSE": "15:1.0"})
    lines = {int(line.split()[1]): line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("step ") and "ms/step" in line}
    assert set(lines) == {10, 20}, proc.stderr[-2000:]
    per_step = {s: float(line.split(" ms/step")[0].rsplit(" ", 1)[1]) for s, line in lines.items()}
    records = {r["step"]: r for r in metrics(run) if "loss" in r}
    interval = (records[20]["time"] - records[10]["time"]) / 10 * 1e3  # steps 11-20, the pause among them
    assert per_step[20] == float(f"{interval:.1f}") and per_step[20] >= 100.0, (per_step, records[20])
    assert per_step[10] == float(f"{records[10]['step_time_s'] * 1e3:.1f}")  # no line before it: its own
