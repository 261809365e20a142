"""The orderly stop's signal handler: records the request, and never logs from inside the handler."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from harness import REPO, SLOW, finish, logged_step, reap, run_cli, start, wait_for  # SLOW: steps of 0.05 s

# Ctrl-C arriving while the main thread is inside a logging call that holds the console queue's lock
# (a worker writing a step's record): a handler that logged there waited for that lock forever.
SCRIPT = r"""
import json, logging, logging.handlers, queue, signal
from elasticflow._util.signals import StopSignal

q = queue.Queue()
log = logging.getLogger("elasticflow")
log.addHandler(logging.handlers.QueueHandler(q))
log.setLevel(logging.INFO)
stop = StopSignal()
with stop.installed():
    with q.mutex:                          # as QueueHandler.emit -> Queue.put holds it
        signal.raise_signal(signal.SIGINT)  # the handler runs here, in this thread
        held = True
    stop.announce()
    stop.announce()                        # once
print(json.dumps({"requested": stop.requested, "logged": [r.getMessage() for r in list(q.queue)]}))
"""


def test_ctrl_c_inside_a_logging_call_is_recorded_and_announced_once_from_the_loop():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["requested"] is True
    assert got["logged"] == ["Ctrl-C: finishing the current step, then writing a checkpoint (Ctrl-C again to abort)"]



@pytest.mark.timeout(120)
def test_ctrl_c_to_a_two_worker_run_is_announced_once_and_status_says_interrupted(tmp_path):
    """A terminal's Ctrl-C reaches the CLI's process group (the agent; workers have sessions of their own):
    the agent said it, and then every worker said it again."""
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=2", "trainer.max_steps=100000", "trainer.log_every=1",
                 "trainer.progress=false", "trainer.global_batch_size=8", model=SLOW, common=[],
                 new_session=True)
    try:
        wait_for(lambda: logged_step(run) >= 2, 90, "step 2", proc=proc)
        os.killpg(proc.pid, signal.SIGINT)
        stderr = finish(proc, timeout=60)  # with stdout: nothing there says Ctrl-C
    finally:
        reap(proc)
    assert proc.returncode == 130, stderr
    assert stderr.count("Ctrl-C:") == 1, stderr  # the agent's line; not once more per worker
    assert stderr.count("interrupted: checkpoint written") == 1
    for worker in (0, 1):  # each worker's own log still says it stopped for the signal
        assert "Ctrl-C: finishing the current step" in (run / "logs" / f"worker-{worker}.log").read_text()
    rows = run_cli(["status", run], check=True).stdout.splitlines()
    assert [r.split()[-1] for r in rows if r.split()[:2] in (["0", "0"], ["1", "1"])] == ["interrupted"] * 2, rows
