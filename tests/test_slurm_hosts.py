"""launcher=slurm across two hosts: a SLURM cluster of namespace hosts h1 and h2 (tests/slurm_cluster.py,
`slurm_hosts`), each with its own network, hostname, processes and slurmd. The job is submitted from h1, as
from a login node; its agent runs on h1 and one worker on each node.

Skipped, with the reason, where the cluster cannot be started (not root, no network namespaces, no SLURM).
"""
import subprocess
from pathlib import Path

import pytest

from harness import (COMMON, ELASTICFLOW, PROBE, assert_each_sample_once, assert_equivalent, events, job_done,
                     job_log, logged_step, members, wait_for, world_sizes)
from slurm_cluster import slurm_hosts, slurm_hosts_cluster  # noqa: F401 - fixtures

TWO_NODES = ["launcher.nodes=2", "launcher.tasks_per_node=1"]


def submit(cluster, run: Path, *overrides: str, env: dict | None = None) -> int:
    """`elasticflow train PROBE launcher=slurm` on two nodes, run on h1; returns the job id."""
    argv = cluster.on("h1", *ELASTICFLOW, "train", PROBE, "launcher=slurm", f"hydra.run.dir={run}", *COMMON,
                      *TWO_NODES, *overrides)
    proc = subprocess.run(argv, env=cluster.host_env({"PYTHONUNBUFFERED": "1", **(env or {})}),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int((run / "slurm" / "job_id").read_text())


def test_two_nodes_train_on_both_and_match_one_worker(slurm_hosts, tmp_path, reference):
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    job = submit(slurm_hosts, run, env={"EF_PROBE_RECORD": str(record)})
    info = job_done(slurm_hosts, job, run)
    assert info["JobState"] == "COMPLETED", job_log(run)
    assert info["NodeList"] == "h[1-2]"
    assert sorted(m["host"] for m in members(run)) == ["h1", "h2"]  # each worker's own hostname
    assert set(world_sizes(run)) == {2}
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)


# Who learns of the loss first: the agent (the lost worker's heartbeat stops for 3 s, and it cuts the worker
# out: srun is terminated), or SLURM (the node is DOWN after ~6 s, before the 60 s heartbeat timeout: srun
# says "Node failure" and exits). Either way srun exits 0, as a worker that finished would.
@pytest.mark.parametrize("heartbeat", [["elastic.heartbeat_timeout_s=3"],
                                       ["elastic.heartbeat_timeout_s=60", "elastic.timeout_s=90"]],
                         ids=["agent-notices-first", "slurm-notices-first"])
def test_a_lost_node_leaves_the_job_training_on_the_other(slurm_hosts, tmp_path, reference, heartbeat):
    run, record, hold, pace = tmp_path / "run", tmp_path / "record", tmp_path / "hold", tmp_path / "pace"
    record.mkdir()
    pace.touch()  # 50 ms steps until the loss, so that it lands mid-job; full speed after
    job = submit(slurm_hosts, run, *heartbeat, env={"EF_PROBE_RECORD": str(record), "EF_PROBE_SLEEP": "0.05",
                                                    "EF_PROBE_PACE": str(pace), "EF_PROBE_HOLD": str(hold)})
    wait_for(lambda: logged_step(run) >= 10, 120, "step 10")
    # Training stands still (every worker inside forward) until SLURM has marked the node DOWN: that is when
    # SLURM would end the job, and when it tells the lost worker's srun.
    hold.touch()
    pace.unlink()
    slurm_hosts.power_off("h2")  # slurmd, the worker's step and the worker die at once
    try:
        wait_for(lambda: slurm_hosts.node_state("h2").startswith("down"), 60, "slurmctld to mark h2 DOWN", every=0.5)
        assert slurm_hosts.state(job) == "RUNNING", slurm_hosts.job_info(job)
    finally:
        hold.unlink()
    info = job_done(slurm_hosts, job, run, timeout=60)  # ~5 s of training left
    assert info["JobState"] == "COMPLETED", job_log(run)
    assert info["Restarts"] == "0", info              # not requeued: the job went on
    assert info["NodeList"] == "h1", info             # SLURM took the failed node out of the allocation
    sizes = world_sizes(run)
    assert sizes[0] == 2 and sizes[-1] == 1
    assert [m["host"] for m in members(run)] == ["h1"]
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)


def test_preemption_on_two_nodes_requeues_and_resumes_on_both(slurm_hosts, tmp_path, reference):
    run, record, pace = tmp_path / "run", tmp_path / "record", tmp_path / "pace"
    record.mkdir()
    pace.touch()  # 50 ms steps until the signal has been handled; the requeued job runs at full speed
    job = submit(slurm_hosts, run, env={"EF_PROBE_SLEEP": "0.05", "EF_PROBE_PACE": str(pace),
                                        "EF_PROBE_RECORD": str(record)})
    wait_for(lambda: logged_step(run) >= 15, 120, "step 15")
    slurm_hosts.signal(job, "USR1", batch=True)   # what SLURM sends launcher.signal's seconds before the end
    slurm_hosts.requeue_now(job, timeout=120)     # test-only: skip SLURM's 120 s hold on a requeued job
    pace.unlink()
    info = job_done(slurm_hosts, job, run)
    assert info["JobState"] == "COMPLETED", job_log(run)
    assert int(info["Restarts"]) >= 1 and info["NodeList"] == "h[1-2]", info
    assert "preempted: checkpoint written; requeueing job" in job_log(run)  # said before SLURM kills the step
    assert sorted(m["host"] for m in members(run)) == ["h1", "h2"]  # the requeued job's workers
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)
    kinds = [e["event"] for e in events(run)]
    assert "preempt" in kinds and kinds.count("started") == 2
