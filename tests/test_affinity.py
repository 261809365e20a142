"""backend.pin_cores: each CPU worker's training thread on its own cores, every other thread free."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ELASTICFLOW, REPO, metrics
from elasticflow._util.affinity import share

ALL = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_free_cores = pytest.mark.skipif(len(ALL) < 2 or len(ALL) != os.cpu_count(),
                                          reason="needs 2+ cores, none of them taken away from this process")


def test_the_cores_are_split_evenly_and_only_when_there_is_something_to_split():
    assert share([0, 1], 0, 2) == [0] and share([1, 0], 1, 2) == [1]
    assert share(range(8), 1, 2) == [4, 5, 6, 7]
    assert share(range(7), 2, 3) == [4, 5]          # the odd core out is left to everyone else's threads
    assert share([0, 1], 0, 1) is None              # one worker: nothing to split
    assert share([0, 1], 0, 4) is None              # more workers than cores
    assert share([0, 1], 2, 2) is None              # a slot past the host's workers (a replacement)


def _threads(pid: int) -> dict:
    """{thread name: [allowed cores, ...]} of a live process, from /proc."""
    out: dict = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out.setdefault(name if int(tid) != pid else "main", []).append(sorted(os.sched_getaffinity(int(tid))))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


PINNED = r"""
import datetime, json, os
from concurrent.futures import ThreadPoolExecutor
import torch.distributed as dist
from elasticflow._util import affinity
from elasticflow.distributed.comm.comm import Group

affinity.pin([0])
group = Group(dist.HashStore(), 0, 0, 1, timeout_s=5)   # gloo's threads start here, in C++
pool = ThreadPoolExecutor(1, initializer=affinity.release)
def mask():
    return sorted(os.sched_getaffinity(0))
import time
deadline = time.monotonic() + 10
while True:   # a thread names itself once it runs: wait for gloo's
    threads = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        threads.setdefault(open(f"/proc/{os.getpid()}/task/{tid}/comm").read().strip(), []).append(
            sorted(os.sched_getaffinity(int(tid))))
    if "gloo_tcp_loop" in threads and len(threads.get("pt_gloo_runloop", [])) >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.01)
print(json.dumps({"main": mask(), "pool": pool.submit(mask).result(), "threads": threads}))
os._exit(0)
"""


@needs_two_free_cores
def test_threads_started_by_the_pinned_thread_are_free():
    out = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["main"] == [0]
    assert got["pool"] == ALL                                  # a pool's initializer releases its thread
    assert got["threads"]["gloo_tcp_loop"] == [ALL]            # a group is built unpinned
    assert all(m == ALL for m in got["threads"]["pt_gloo_runloop"])


def _two_workers(run_dir: Path, *overrides: str) -> dict:
    """Start a 2-worker run, read every thread's cores once it trains, then stop it with Ctrl-C."""
    cmd = ELASTICFLOW + ["train", str(REPO / "models" / "digits_mlp.py"), f"hydra.run.dir={run_dir}",
                         "launcher.workers=2", "trainer.max_steps=100000", "trainer.progress=false",
                         "trainer.log_every=10", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not any(r.get("step", 0) >= 20 for r in metrics(run_dir)):
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not reach step 20"
            time.sleep(0.1)
        members = json.loads((run_dir / "workers.json").read_text())["members"]
        seen = {m["rank"]: _threads(m["pid"]) for m in members}
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]   # Ctrl-C's exit: the run stopped as asked, nothing failed
    assert "Ctrl-C: workers finish the current step" in out   # logged by the agent's loop, not its handler
    return seen


@needs_two_free_cores
def test_each_workers_training_thread_has_its_own_cores_and_gloos_threads_have_all(tmp_path):
    seen = _two_workers(tmp_path / "run")
    mains = [seen[r]["main"][0] for r in (0, 1)]
    half = len(ALL) // 2
    assert mains == [ALL[:half], ALL[half:2 * half]]
    for r in (0, 1):
        assert seen[r]["gloo_tcp_loop"] == [ALL]
        assert all(m == ALL for m in seen[r]["pt_gloo_runloop"])


@needs_two_free_cores
def test_pin_cores_false_leaves_every_thread_free(tmp_path):
    seen = _two_workers(tmp_path / "run", "backend.pin_cores=false")
    assert all(m == ALL for r in (0, 1) for masks in seen[r].values() for m in masks)
