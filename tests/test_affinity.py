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


# ---------------------------------------------------------------- the default number of intra-op threads
from elasticflow._util import affinity  # noqa: E402
from elasticflow._util.affinity import Cores, cgroup_cpu_limit, default_threads, others_running  # noqa: E402


def _cgroup(tmp_path, own: str, files: dict) -> tuple:
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    (tmp_path / "own").write_text(own)
    return str(tmp_path / "fs"), str(tmp_path / "own")


def test_the_cgroup_quota_is_read_from_cpu_max_or_cfs_quota_the_smallest_on_the_path(tmp_path):
    root, own = _cgroup(tmp_path / "v2", "0::/job/worker\n", {"job/cpu.max": "150000 100000\n",
                                                              "job/worker/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, own) == 1.5      # the parent's quota binds its child
    root, own = _cgroup(tmp_path / "v2max", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, own) is None     # "max": no quota
    root, own = _cgroup(tmp_path / "v1", "4:memory:/x\n3:cpu,cpuacct:/x\n0::/\n",
                        {"cpu,cpuacct/x/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n",
                         "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, own) == 3.0
    assert cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "no-such-file")) is None


def test_other_processes_count_by_the_threads_they_keep_running(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4\nprocs_running 3\nprocs_blocked 0\n")
    assert others_running(str(stat), samples=2, gap_s=0) == 2.0   # less the thread that looks
    stat.write_text("procs_running 1\n")
    assert others_running(str(stat), samples=1) == 0.0
    assert others_running(str(tmp_path / "absent")) == 0.0


def test_the_default_threads_are_the_share_of_the_usable_cores_no_other_process_holds():
    assert default_threads(2, Cores(2)) == 2                           # an idle 2-core host, one worker
    assert default_threads(2, Cores(2, busy=2.0)) == 1                 # two CPU hogs: one thread, not two fighting
    assert default_threads(2, Cores(2, busy=1.0)) == 1
    assert default_threads(4, Cores(8, busy=3.0)) == 4                 # 2 workers on 8 cores, 3 busy: still 4 each
    assert Cores(16, limit=2.5).usable == 2 and Cores(2, limit=0.5).usable == 1   # a quota caps, rounding down
    assert default_threads(2, Cores(64, limit=2.0, busy=40.0)) == 2    # a container's quota on a busy big host
    assert "2 cores allowed, cgroup quota 1.5, 3 threads of other processes running" in Cores(2, 1.5, 3.0).describe()


def test_a_placed_process_does_not_look_at_the_hosts_load(monkeypatch):
    monkeypatch.setattr(affinity, "others_running", lambda: 9.0)
    monkeypatch.setattr(affinity, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert affinity.cores() == Cores(2, None, 0.0)                  # taskset / --cpu-bind gave it these two
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert affinity.cores() == Cores(4, None, 9.0)
    assert affinity.cores(look=False) == Cores(4, None, 0.0)


THREADS_MODEL = """
import numpy as np
def model(cfg):
    return {"w": np.zeros((4, 1), np.float32)}
def forward(x, y, params):
    from elasticflow import ops
    return {"loss": ops.mean((x @ params["w"] - y) ** 2)}
def data(cfg):
    return np.ones((16, 4), np.float32), np.ones((16, 1), np.float32)
"""


def test_a_worker_takes_its_hosts_share_its_free_cores_or_backend_threads_and_the_banner_says_which(
        tmp_path, monkeypatch, caplog):
    import logging

    import torch

    from elasticflow.config.schema import compose
    from elasticflow.distributed import protocol
    from elasticflow.trainer import ElasticTrainer

    path = tmp_path / "m.py"
    path.write_text(THREADS_MODEL)
    monkeypatch.setattr(affinity, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    before = torch.get_num_threads()
    try:
        for k, (workers, busy, overrides, want, says) in enumerate((
                ("1", 0.0, [], 8, "8 intra-op threads per worker (8 cores allowed; backend.threads overrides)"),
                ("2", 0.0, [], 4, "4 intra-op threads per worker"),                 # 2 workers on this host
                ("1", 6.0, [], 2, "2 intra-op threads per worker (8 cores allowed, 6 threads of other"),
                ("2", 6.0, ["backend.threads=3"], 3, "3 intra-op threads per worker (backend.threads)"))):
            monkeypatch.setattr(affinity, "others_running", lambda busy=busy: busy)
            monkeypatch.setenv(protocol.ENV_LOCAL_WORKERS, workers)
            cfg = compose(str(path), ["trainer.global_batch_size=4", "trainer.max_steps=1", *overrides])
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="elasticflow"):
                ElasticTrainer(str(path), cfg, run_dir=str(tmp_path / f"run{k}")).prepare()
            assert torch.get_num_threads() == want, (workers, busy, overrides)
            assert says in caplog.text, caplog.text
    finally:
        torch.set_num_threads(before)
