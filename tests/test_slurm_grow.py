"""launcher=slurm launcher.max_nodes=2 on the SLURM cluster of namespace hosts h1, h2 (tests/slurm_cluster.py):
the job starts on the node that is free, grows into h2 when another job gives it back, shrinks when its
worker job is cancelled (scancel) or scaled down (`elasticflow scale`), and leaves nothing in the queue.

Skipped, with the reason, where the cluster cannot be started (not root, no network namespaces, no SLURM).
"""
import json
import os
import subprocess
from pathlib import Path

from harness import (COMMON, ELASTICFLOW, PROBE, REPO, assert_each_sample_once, assert_equivalent, cli, events,
                     Limit, job_done, job_log, logged_step, wait_for, world_sizes)
from slurm_cluster import slurm_hosts, slurm_hosts_cluster  # noqa: F401 - fixtures

GROW = ["launcher.nodes=1", "launcher.max_nodes=2", "launcher.tasks_per_node=1"]


def submit(cluster, run: Path, env: dict) -> int:
    argv = cluster.on("h1", *ELASTICFLOW, "train", PROBE, "launcher=slurm", f"hydra.run.dir={run}", *COMMON, *GROW)
    proc = subprocess.run(argv, env=cluster.host_env({"PYTHONUNBUFFERED": "1", **env}), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int((run / "slurm" / "job_id").read_text())


def worker_jobs(run: Path, state: str = "SUBMITTED") -> list:
    return [e["job"] for e in events(run) if e["event"] == "worker_job" and e.get("state") == state]


def admitted_on(run: Path, host: str) -> bool:
    """A worker on HOST is a member, or admitted (it enters the next generation)."""
    try:
        snapshot = json.loads((run / "workers.json").read_text())
    except (OSError, ValueError):
        return False
    return any(w.get("host") == host and (w.get("state") == "admitted" or w in snapshot["members"])
               for w in snapshot["joining"] + snapshot["members"])


def queued(cluster) -> list:
    """Every job in the queue, as 'id name state'."""
    return [" ".join(row) for row in cluster.squeue(fmt="%i %j %T")]


def logged_steps(run: Path) -> int:
    return len(world_sizes(run))


def poll(predicate, timeout: float, what: str, every: float = 0.25):
    return wait_for(predicate, timeout, what, every=every)  # each poll may be a SLURM command


def test_grows_into_a_freed_node_shrinks_on_scancel_and_leaves_nothing_queued(slurm_hosts, tmp_path, reference):
    run, record, pace, hold = tmp_path / "run", tmp_path / "record", tmp_path / "pace", tmp_path / "hold"
    record.mkdir()
    blocker = slurm_hosts.sbatch_wrap("sleep 600", "--nodelist=h2", "--exclusive", "--job-name=blocker",
                                      "--output=/dev/null")
    slurm_hosts.wait_state(blocker, "RUNNING")
    pace.touch()
    job = submit(slurm_hosts, run, {"EF_PROBE_RECORD": str(record), "EF_PROBE_SLEEP": "0.1",
                                    "EF_PROBE_PACE": str(pace), "EF_PROBE_HOLD": str(hold)})
    # The job starts on h1 at once; its worker job for h2 waits behind the blocker.
    poll(lambda: logged_steps(run) >= 5, 120, "the job's first steps on h1")
    assert slurm_hosts.job_info(job)["NodeList"] == "h1"
    [worker_job] = poll(lambda: worker_jobs(run), 30, "the worker job's submission")
    assert slurm_hosts.state(int(worker_job)) == "PENDING"
    assert "--exclude=h1" in (run / "slurm" / "worker.sbatch").read_text()
    # The blocker ends: SLURM starts the worker job on h2 and its worker joins. Training is held still
    # until it is admitted, so that the test does not race the job's 60 steps.
    hold.touch()
    slurm_hosts.cancel(blocker)
    try:
        poll(lambda: admitted_on(run, "h2"), 90, "the worker on h2 to be admitted")
        assert slurm_hosts.job_info(int(worker_job))["NodeList"] == "h2"
    finally:
        hold.unlink()
    poll(lambda: logged_steps(run) and 2 in world_sizes(run), 60, "a step with 2 workers")
    # scancel of the worker job: its worker leaves, the job goes on with h1 alone, nothing is resubmitted.
    grown_at = logged_steps(run)
    slurm_hosts.cancel(int(worker_job))
    poll(lambda: world_sizes(run)[-1] == 1 and logged_steps(run) > grown_at, 60, "a step with 1 worker again")
    pace.unlink()
    info = job_done(slurm_hosts, job, run)
    assert info["JobState"] == "COMPLETED", job_log(run)
    sizes = world_sizes(run)
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1, sizes
    assert worker_jobs(run) == [worker_job], "a cancelled worker job is given back, not submitted again"
    assert_equivalent(run, reference)
    assert_each_sample_once(run, record)
    poll(lambda: not queued(slurm_hosts), 30, f"an empty queue (left: {queued(slurm_hosts)})")


def test_scale_down_cancels_the_worker_job_and_the_end_cancels_a_queued_one(slurm_hosts, tmp_path, reference):
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 3)
    job = submit(slurm_hosts, run, {"EF_PROBE_LIMIT": str(limit.path)})
    [worker_job] = poll(lambda: worker_jobs(run), 60, "the worker job's submission")
    poll(lambda: admitted_on(run, "h2"), 120, "the worker on h2 (h2 is free) to be admitted")
    limit.advance_until(run, lambda: 2 in world_sizes(run), 120, "a step with 2 workers")
    # `elasticflow scale RUN 1`: the worker job's worker retires at a step boundary, then its job ends.
    slurm_hosts.run(*ELASTICFLOW, "scale", run, "--workers", "1", "--wait", "0", cwd=REPO)
    limit.advance_until(run, lambda: events(run, "retired"), 120, "the worker on h2 to retire")
    poll(lambda: slurm_hosts.state(int(worker_job)) in ("COMPLETED", "CANCELLED"), 60, "the worker job's end")
    # Grow again: a new worker job. Make it wait in the queue (h2 taken), then let the job finish: the
    # queued worker job is cancelled with it.
    blocker = slurm_hosts.sbatch_wrap("sleep 600", "--nodelist=h2", "--exclusive", "--job-name=blocker",
                                      "--output=/dev/null")
    slurm_hosts.wait_state(blocker, "RUNNING")
    slurm_hosts.run(*ELASTICFLOW, "scale", run, "--workers", "2", "--wait", "0", cwd=REPO)
    second = poll(lambda: worker_jobs(run)[1:], 30, "a second worker job")[0]
    assert slurm_hosts.state(int(second)) == "PENDING"
    assert slurm_hosts.state(job) == "RUNNING", "the job ended before the test let it"
    limit.lift()  # to the end
    info = job_done(slurm_hosts, job, run)
    assert info["JobState"] == "COMPLETED", job_log(run)
    assert slurm_hosts.state(int(second)) == "CANCELLED"
    assert world_sizes(run)[-1] == 1
    assert_equivalent(run, reference)
    slurm_hosts.cancel(blocker)
    poll(lambda: not queued(slurm_hosts), 30, f"an empty queue (left: {queued(slurm_hosts)})")


def test_scancel_of_the_job_itself_cancels_its_worker_jobs(slurm_hosts, tmp_path):
    run, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()  # training stands still: the job is cancelled mid-run, with its worker job running
    job = submit(slurm_hosts, run, {"EF_PROBE_HOLD": str(hold)})
    [worker_job] = poll(lambda: worker_jobs(run), 60, "the worker job's submission")
    poll(lambda: admitted_on(run, "h2"), 90, "the worker on h2 to be admitted")
    slurm_hosts.cancel(job)  # SIGTERM to the agent (the batch shell), SIGKILL KillWait later
    poll(lambda: not queued(slurm_hosts), 30, f"an empty queue (left: {queued(slurm_hosts)})")
    assert slurm_hosts.state(int(worker_job)) == "CANCELLED"
    hold.unlink()


# ---------------------------------------------------------------------------------------------------------
# How worker jobs are kept, against SLURM commands that do what a test says (no cluster): which endings
# bring a worker job back, which give its node back, and that the job's end cancels every one.
FAKE = {
    "sbatch": 'n=$(( $(cat "$Q/next" 2>/dev/null || echo 100) + 1 )); echo $n > "$Q/next"; '
              'echo PENDING > "$Q/$n.job"; echo "$@" >> "$Q/sbatch.log"; '
              '[ -e "$Q/refuse" ] && { echo "sbatch: error: Batch job submission failed: QOS limit" >&2; exit 1; }; '
              'echo "$n"',
    "squeue": 'for f in "$Q"/*.job; do [ -e "$f" ] || continue; s=$(cat "$f"); '
              'case $s in PENDING|RUNNING|COMPLETING) echo "$(basename "$f" .job) $s";; esac; done',
    "scontrol": 'f="$Q/$4.job"; [ -e "$f" ] && echo "JobId=$4 JobName=x JobState=$(cat "$f") Reason=None"',
    "scancel": 'for j in "$@"; do echo CANCELLED > "$Q/$j.job"; echo "$j" >> "$Q/scancel.log"; done',
}


class FakeWorker:
    def __init__(self, node):
        self.id = int(node.split("job")[-1])  # one worker a job here: the job's number will do
        self.node, self.exit_code, self.state, self.signalled = node, None, "training", []

    def signal(self, sig):
        self.signalled.append(sig)


class FakeAgent:
    """What WorkerJobs reads of the agent: its workers, in a real Roster (distributed/agent/roster.py)."""

    def __init__(self):
        from elasticflow.distributed.agent.roster import Roster

        self.roster = Roster()
        self.interrupted, self.finished, self.stop_reason, self.dirty, self.events = False, [], "", False, []

    def _place(name):
        return property(lambda self: getattr(self.roster, name),
                        lambda self, workers: getattr(self.roster, name).__setitem__(slice(None), workers))

    members, waiting, admitted, retiring = _place("members"), _place("waiting"), _place("admitted"), _place("retiring")

    def live(self):
        return self.roster.live()

    def event(self, kind, **fields):
        self.events.append((kind, fields))


def fake_slurm(tmp_path, monkeypatch) -> Path:
    import elasticflow.launchers.slurm_grow as grow

    bin_dir, q = tmp_path / "bin", tmp_path / "q"
    bin_dir.mkdir()
    q.mkdir()
    for name, body in FAKE.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nQ={q}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(grow, "POLL_S", 0.05)
    return q


def state_of(q: Path, job: str) -> str:
    return (q / f"{job}.job").read_text().strip()


def settle(jobs, agent, until, what):
    return poll(lambda: (jobs.serve(agent), until())[1], 10, what, every=0.05)


def test_worker_jobs_come_back_after_preemption_not_after_a_cancel_and_end_with_the_job(tmp_path, monkeypatch):
    from elasticflow.config.schema import compose
    from elasticflow.launchers.slurm_grow import WorkerJobs

    q = fake_slurm(tmp_path, monkeypatch)
    cfg = compose(str(PROBE), ["launcher=slurm", "launcher.nodes=1", "launcher.max_nodes=3",
                               "launcher.partition=gpu", "launcher.time=01:00:00"])
    agent, run = FakeAgent(), tmp_path / "run"
    jobs = WorkerJobs(cfg, run, "abc123")
    script = (run / "slurm" / "worker.sbatch").read_text()
    assert "--partition=gpu" in script and "--time=01:00:00" in script and "--no-requeue" in script
    assert "elasticflow.launchers.slurm_grow" in script and script.rstrip().endswith("abc123")
    settle(jobs, agent, lambda: len(jobs.jobs) == 2, "two worker jobs (max_nodes - nodes)")
    assert sorted(jobs.jobs) == ["101", "102"]
    # 101 runs, its worker is a member; then the cluster preempts it: the worker leaves, a new job is queued.
    (q / "101.job").write_text("RUNNING\n")
    worker = FakeWorker("h2-job101")
    agent.members.append(worker)
    settle(jobs, agent, lambda: jobs.jobs["101"].state == "RUNNING", "101 running")
    (q / "101.job").write_text("PREEMPTED\n")
    settle(jobs, agent, lambda: "103" in jobs.jobs, "a worker job in place of the preempted one")
    assert worker.exit_code == -9 and "101" not in jobs.jobs
    # 102 is cancelled by someone: given back, not submitted again.
    (q / "102.job").write_text("CANCELLED\n")
    settle(jobs, agent, lambda: "102" not in jobs.jobs, "102 forgotten")
    jobs.serve(agent)
    assert sorted(jobs.jobs) == ["103"] and jobs.wanted == 1
    # Scale down to the allocation: the queued job is cancelled at once (it has no workers).
    assert jobs.rescale(agent, 1) == 0
    settle(jobs, agent, lambda: state_of(q, "103") == "CANCELLED", "103 cancelled by the scale-down")
    # Scale up to 3: two jobs; 2 workers on their way, which scaling.py counts as present.
    assert jobs.rescale(agent, 3) == 0  # nothing queued yet: the submissions go out at the next serve
    settle(jobs, agent, lambda: len(jobs.jobs) == 2, "two worker jobs again")
    assert jobs.rescale(agent, 3) == 2
    # A running worker job whose workers are scaled away retires them, then is cancelled once they left.
    # (Both run: with one queued, the queued one would go first.)
    oldest, newest = sorted(jobs.jobs, key=int)
    for job in (oldest, newest):
        (q / f"{job}.job").write_text("RUNNING\n")
    member = FakeWorker(f"h3-job{newest}")
    agent.members += [FakeWorker(f"h2-job{oldest}"), member]
    settle(jobs, agent, lambda: {j.state for j in jobs.jobs.values()} == {"RUNNING"}, "both running")
    assert jobs.rescale(agent, 2) == 0
    assert member in agent.retiring and member not in agent.members and agent.dirty
    jobs.serve(agent)
    assert state_of(q, newest) == "RUNNING", "cancelled only once its worker has left"
    agent.retiring.remove(member)
    settle(jobs, agent, lambda: state_of(q, newest) == "CANCELLED", "the released job cancelled")
    # The job ends: every worker job left is cancelled.
    jobs.close(agent)
    assert all(state_of(q, j) not in ("PENDING", "RUNNING") for j in jobs.jobs)
    assert not jobs._thread.is_alive()


def test_a_refused_worker_job_stops_growing_with_one_warning(tmp_path, monkeypatch, caplog):
    from elasticflow.config.schema import compose
    from elasticflow.launchers.slurm_grow import WorkerJobs

    q = fake_slurm(tmp_path, monkeypatch)
    (q / "refuse").touch()
    cfg = compose(str(PROBE), ["launcher=slurm", "launcher.nodes=1", "launcher.max_nodes=2",
                               "launcher.tasks_per_node=2"])
    agent = FakeAgent()
    jobs = WorkerJobs(cfg, tmp_path / "run", "abc123")
    assert "whole nodes of launcher.tasks_per_node=2" in jobs.rescale(agent, 3)
    settle(jobs, agent, lambda: jobs.refusal, "the refusal")
    for _ in range(5):
        jobs.serve(agent)
    assert "QOS limit" in jobs.refusal and not jobs.jobs
    assert len((q / "sbatch.log").read_text().splitlines()) == 1, "not submitted again and again"
    assert [k for k, f in agent.events if f.get("state") == "REFUSED"] == ["worker_job"]
    jobs.close(agent)


def test_max_nodes_is_checked_before_anything_is_submitted(tmp_path):
    for overrides, says in ((["launcher=slurm", "launcher.nodes=2", "launcher.max_nodes=1"],
                             "launcher.max_nodes=1 is less than launcher.nodes=2"),
                            (["launcher.max_nodes=2"], "launcher.max_nodes=2 is for launcher=slurm only")):
        run = tmp_path / "run"
        proc = cli(["train", PROBE, f"hydra.run.dir={run}", *overrides])
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert not (run / "slurm").exists()
