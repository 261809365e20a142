"""The orderly stop's signal handler: records the request, and never logs from inside the handler."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

# Ctrl-C arriving while the main thread is inside a logging call that holds the console queue's lock
# (a worker writing a step's record): a handler that logged there waited for that lock forever.
SCRIPT = r"""
import json, logging, logging.handlers, queue, signal
from elasticflow.signals import StopSignal

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
