"""Rank 0's step records (reporting.StepLog): when each record reaches metrics.jsonl, and what a new rank 0
writes for the one that left. tests/test_elastic.py's rank0-before-writing-a-record kills a real rank 0 at
the point these cover."""
import json
import logging
import os
import select
import pty
import struct
import sys

import pytest

from elasticflow.observability import status as run_status
from elasticflow.observability.reporting import Progress, RunLog, StepLog, membership_line, step_line

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
    lines = {int(line.split()[1].split("/")[0]): line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("step ") and "ms/step" in line}
    assert set(lines) == {10, 20}, proc.stderr[-2000:]
    # Not a terminal (captured output), and still the step of the total, samples/s and the ETA (issue 68).
    assert lines[10].startswith("step 10/20 ") and " samples/s ETA " in lines[10], lines[10]
    assert " ETA 0:00 " in lines[20], lines[20]
    per_step = {s: float(line.split(" ms/step")[0].rsplit(" ", 1)[1]) for s, line in lines.items()}
    records = {r["step"]: r for r in metrics(run) if "loss" in r}
    interval = (records[20]["time"] - records[10]["time"]) / 10 * 1e3  # steps 11-20, the pause among them
    assert per_step[20] == float(f"{interval:.1f}") and per_step[20] >= 100.0, (per_step, records[20])
    assert per_step[10] == float(f"{records[10]['step_time_s'] * 1e3:.1f}")  # no line before it: its own


def shown_lines(caplog) -> dict:
    return {int(r.getMessage().split()[1].split("/")[0]): r.getMessage() for r in caplog.records
            if r.getMessage().startswith("step ")}


def test_step_lines_carry_the_total_samples_per_s_and_an_eta_without_a_terminal(tmp_path, caplog):
    """Steps 1 s apart, 64 samples each, every 10th shown out of 100: 64 samples/s, 1000 ms/step, and at step 30 an
    ETA of 70 steps at 1 s. The ETA's pace is the last few lines' (a slow interval moves it only in part)."""
    log = step_log(tmp_path, log_every=10, total_steps=100)
    with caplog.at_level(logging.INFO, logger="elasticflow"):
        for step in range(1, 31):
            log.ended(record(step), rank=0, world=1)
        slow = {**record(40), "time": 1000.0 + 30 + 40}  # steps 31-40 took 4 s each
        log.ended(slow, rank=0, world=1)
    lines = shown_lines(caplog)
    assert lines[10] == "step 10/100 epoch 0 loss 0.1 lr 0.1 samples 640 1.0 ms/step 64,000 samples/s ETA 0:00"
    assert lines[30] == "step 30/100 epoch 0 loss 0.033333 lr 0.1 samples 1920 1000.0 ms/step 64 samples/s ETA 1:10"
    # 4 s/step over the last interval; the ETA at the pace of steps 10-40 (60 s for 30 steps): 60 steps at 2 s
    assert lines[40] == "step 40/100 epoch 0 loss 0.025 lr 0.1 samples 2560 4000.0 ms/step 16 samples/s ETA 2:00"


def test_a_step_line_without_a_known_total_has_no_eta():
    line = step_line(record(5), total=None)
    assert line.startswith("step 5 epoch") and "ETA" not in line and "64,000 samples/s" in line


def test_a_terminal_of_zero_columns_still_shows_the_bar(monkeypatch):
    """A pseudo-terminal that reports 0 columns: tqdm drew nothing there, and the run looked dead (issue 68)."""
    master, slave = pty.openpty()
    import fcntl
    import termios
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    terminal = os.fdopen(slave, "w")
    try:
        monkeypatch.setattr(sys, "stderr", terminal)
        bar = Progress(None, 10, 0)  # None: on because stderr is a terminal
        assert bar.active
        for _ in range(3):
            bar.update(0.5, 1000.0, world=2, generation=1)
        bar.close()
        terminal.flush()
        terminal.close()  # the slave closed: the master reads what it holds, then EIO (one read may stop short)
        chunks = []
        while select.select([master], [], [], 1.0)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        shown = b"".join(chunks).decode(errors="replace")
    finally:
        if not terminal.closed:
            terminal.close()
        os.close(master)
    assert "3/10" in shown and "loss=0.5" in shown, repr(shown)


DIED = {"gone": [1], "pids": {"1": 123}, "causes": {"1": "signal SIGKILL"}}


@pytest.mark.parametrize("args,said", [
    ((39, [0, 1, 2], [0, 2], DIED, True, True),
     "worker 1 (pid 123) died at step 39 (signal SIGKILL): continuing with 2 workers, step 39 redone"),
    ((39, [0, 1, 2], [0, 2], DIED, True, False),  # a member had committed it: the others adopted its state
     "worker 1 (pid 123) died at step 39 (signal SIGKILL): continuing with 2 workers, nothing redone"),
    ((120, [0, 1], [0, 1, 3], {"gone": [], "pids": {"3": 77}}, False, False),
     "worker 3 (pid 77) joined at step 120: 3 workers"),
    ((17, [0, 1], [0, 1, 2, 3], {"gone": []}, False, False), "worker 2 and worker 3 joined at step 17: 4 workers"),
    ((45, [0, 1, 2], [0, 1], {"gone": [], "pids": {"2": 9}}, False, False),
     "worker 2 (pid 9) retired at step 45: 2 workers"),
    ((7, [0, 1], [0], {"gone": [1], "pids": {"1": 5}, "causes": {"1": "hung: no heartbeat for 5.0s"}}, True, True),
     "worker 1 (pid 5) hung at step 7 (no heartbeat for 5.0s) and was stopped: continuing with 1 worker, "
     "step 7 redone"),
    # a generation superseded in between (a second death): its member named without what only its record held
    ((8, [0, 1, 2], [0], {"gone": [2], "pids": {"2": 6}}, True, True),
     "worker 1 died at step 8; worker 2 (pid 6) died at step 8: continuing with 1 worker, step 8 redone"),
    ((8, [0, 1], [0, 1], {"gone": []}, True, True),
     "a collective of step 8 failed with every member still in the job: continuing with 2 workers, step 8 redone"),
    ((8, [0, 1], [0, 1], {"gone": []}, False, False), None),
    # a record from elsewhere (the agent seals it; read as untrusted all the same)
    ((8, [0, 1], [0], {"gone": "x", "pids": {"1": "rm -rf"}, "causes": []}, True, True),
     "worker 1 died at step 8: continuing with 1 worker, step 8 redone"),
    ((8, [0, 1], [0], {"gone": [1], "causes": {"1": "exit code 1\x1b[2J"}}, True, True),
     "worker 1 died at step 8 (exit code 1\\x1b[2J): continuing with 1 worker, step 8 redone"),
])
def test_membership_changes_in_plain_words(args, said):
    step, before, after, rec, failed, redone = args
    assert membership_line(step, before, after, rec, failed=failed, redone=redone) == said


def test_below_min_workers_the_line_says_the_job_stops():
    line = membership_line(3, [0, 1], [0], DIED, failed=True, redone=True, stopping=True)
    assert line.endswith(": stopping with 1 worker, fewer than launcher.min_workers (a checkpoint is written)")


def test_status_says_step_n_of_m_and_an_eta_while_running(tmp_path):
    """Records 2 s a step apart, step 30 of 100 logged: 70 steps at 2 s. Not running: no ETA."""
    (tmp_path / ".elasticflow").mkdir()
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 31):
            f.write(json.dumps({**record(step), "time": 1000.0 + 2 * step}) + "\n")
    (tmp_path / ".elasticflow" / "schedule.json").write_text(json.dumps({"total_steps": 100}))
    done = run_status.status(tmp_path).splitlines()
    assert [line for line in done if line.startswith("step ")] == [
        "step 30 of 100  epoch 0  samples consumed 1920  loss 0.033333  lr 0.1"]
    import socket
    from elasticflow.distributed import protocol
    closed = socket.socket()  # an agent file (running), whose store answers nothing: no devices, the rest
    closed.bind(("127.0.0.1", 0))
    protocol.agent_file(tmp_path).write_text(json.dumps({"address": f"127.0.0.1:{closed.getsockname()[1]}", "pid": 1}))
    closed.close()
    running = run_status.status(tmp_path).splitlines()
    assert [line for line in running if line.startswith("step ")] == [
        "step 30 of 100  epoch 0  samples consumed 1920  loss 0.033333  lr 0.1  ETA 2:20"]
    assert run_status.status_record(tmp_path)["total_steps"] == 100
