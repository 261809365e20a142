"""launcher=slurm with launcher.max_nodes: start with the allocation, grow into nodes SLURM frees later.

The job starts as soon as its own allocation (launcher.nodes) is granted. For every node it lacks up to
max_nodes, the agent submits a single-node *worker job*: the same partition, account, time limit and
resources, excluding the allocation's nodes, named after the run, its output in
RUN_DIR/slurm/worker-<jobid>.out. While the cluster is busy the worker jobs wait in the queue; when SLURM
starts one, its batch script (``python -m elasticflow.launchers.slurm_grow RUN_DIR JOB``) runs a node
agent (distributed/agent/node_agent.py) that joins the running job with the run's token and starts
launcher.tasks_per_node workers as srun steps of the worker job. They enter at the next step boundary, as
any joiner does: the global batch and the sample order are unchanged.

A worker job that ends -- preempted, its time limit, its node lost, scancel -- takes its workers out of the
job, which goes on without them. One that was preempted, timed out or lost its node is submitted again
(it waits in the queue until capacity frees up); one that was cancelled (scancel: someone wants the node
back) or failed is not. `elasticflow scale` adds or cancels worker jobs first: queued ones, then the newest
running ones, whose workers retire at a step boundary before their job ends. When the job ends, however
it ends (finished, an error, Ctrl-C, preemption, scancel of the job itself), every worker job is
cancelled.

SLURM's commands run in a thread of their own: sbatch, squeue and scancel take tens of milliseconds (seconds
from a busy slurmctld) and the agent's loop polls its workers every 10 ms.

Note: if the agent's own node dies (SIGKILL, power), nothing is left to cancel the worker jobs: a running
one's node agent gives up after elastic.wait_s without the agent, and a queued one that starts later finds
the run's agent gone and exits at once.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..distributed import protocol
from ..distributed.store.stores import host_of
from .._util.paths import read_beneath
from ..errors import ElasticFlowError
from .slurm_jobs import resources, sbatch_lines, srun_launch

log = logging.getLogger("elasticflow")
POLL_S = 1.0        # how often squeue is asked about the worker jobs: slurmctld serves the whole cluster
CLOSE_S = 15.0      # at the end, how long the agent waits for its cancellations to be carried out
# A worker job that ended in one of these is submitted again: the cluster took the node, not the user.
AGAIN = frozenset({"PREEMPTED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"})
QUEUED = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING"})


def node_name(host: str, job: str) -> str:
    """A worker job's node agent name: two worker jobs can share a node, so the host name is not enough."""
    return f"{host}-job{job}"


def _of(job: str, node: Optional[str]) -> bool:
    return node is not None and node.endswith(f"-job{job}")


def _slurm_env() -> Dict[str, str]:
    """A submission from inside the job must not inherit its SLURM_* settings (its node list, its tasks)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}


class WorkerJob:
    def __init__(self, job: str):
        self.job = job
        self.state = "PENDING"
        self.releasing = False   # given back by a scale-down: its workers retire, then the job is cancelled
        self.cancelled = False   # scancel sent by us

    @property
    def live(self) -> bool:
        return not self.releasing


class WorkerJobs:
    """The agent's ``capacity`` (distributed/agent/agent.py): worker jobs for the nodes the allocation lacks. Its
    ``serve``, ``rescale`` and ``close`` are handed the agent's state (distributed/agent/state.py) as ``agent``."""

    def __init__(self, cfg: Any, run_dir: Path, run_job: str):
        lc = cfg.launcher
        self.cfg, self.run_dir, self.run_job = cfg, Path(run_dir), run_job
        self.per_node = lc.tasks_per_node
        self.own = lc.nodes * lc.tasks_per_node       # the allocation's workers
        self.most = lc.max_nodes - lc.nodes           # worker jobs at most
        self.wanted = self.most                       # worker jobs wanted now (`elasticflow scale` moves it)
        self.jobs: Dict[str, WorkerJob] = {}          # queued or running, by SLURM job id
        self.asked = 0                                # submissions sent, not yet answered
        self.name = f"ef-{run_job}-w"                 # squeue finds the run's worker jobs by this name
        self.script = self.run_dir / "slurm" / "worker.sbatch"
        self.script.parent.mkdir(parents=True, exist_ok=True)
        self.script.write_text(self.worker_script())
        self.stopped = False                          # no more submissions (the job ends)
        self.aborted = False                          # cancel_now: the thread cancels everything and ends
        self.refusal = ""                             # sbatch's refusal: growing stops, said once
        self._orders: "queue.Queue[tuple]" = queue.Queue()
        self._answers: "queue.Queue[tuple]" = queue.Queue()
        self._thread = threading.Thread(target=self._slurm, name="elasticflow-worker-jobs", daemon=True)
        self._thread.start()

    def worker_script(self) -> str:
        lc = self.cfg.launcher
        directives = [f"--job-name={self.name}", "--nodes=1", f"--ntasks-per-node={lc.tasks_per_node}",
                      # ended by preemption, it is submitted afresh by the agent (AGAIN), not requeued by SLURM
                      "--no-requeue", f"--output={self.run_dir}/slurm/worker-%j.out"]
        nodes = os.environ.get("SLURM_JOB_NODELIST")
        if nodes:  # another node: the allocation's own are the job's already
            directives.append(f"--exclude={nodes}")
        lines = sbatch_lines(directives + resources(lc)) + [
            "# Written by elasticflow: one node more for a running job. Its node agent joins the job's agent",
            "# (RUN_DIR/.elasticflow/agent.json) and starts this node's workers as srun steps.",
            f"cd {shlex.quote(str(Path.cwd()))}",
            f"exec {shlex.quote(sys.executable)} -m elasticflow.launchers.slurm_grow "
            f"{shlex.quote(str(self.run_dir))} {self.run_job}"]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ the agent's loop (main thread)
    def serve(self, agent) -> None:
        while True:
            try:
                kind, value = self._answers.get_nowait()
            except queue.Empty:
                break
            if kind == "submitted":
                self.asked -= 1
                self.jobs[value] = WorkerJob(value)
                agent.event("worker_job", job=value, state="SUBMITTED")
                log.info("submitted worker job %s for one node more (launcher.max_nodes=%d)", value,
                         self.cfg.launcher.max_nodes)
            elif kind == "refused":
                self.asked -= 1
                if not self.refusal:
                    self.refusal = value
                    log.warning("sbatch refused a worker job, so the job does not grow: %s", value)
                    agent.event("worker_job", state="REFUSED", reason=value)
            elif kind == "states":
                self._states(agent, value)
        ending = agent.interrupted or agent.finished or agent.stop_reason
        self.stopped = self.stopped or bool(ending)
        for job in [j for j in self.jobs.values() if j.releasing and not j.cancelled]:
            if not any(_of(job.job, w.node) for w in agent.live()):  # its workers have left: give the node back
                self._cancel(job)
        missing = self.wanted - sum(j.live for j in self.jobs.values()) - self.asked
        if missing > 0 and not (self.stopped or self.refusal):
            for _ in range(missing):
                self.asked += 1
                self._orders.put(("submit", None))

    def _states(self, agent, states: Dict[str, str]) -> None:
        """squeue's news: a worker job's state changed (after COMPLETING, the final one from scontrol)."""
        for job_id, state in states.items():
            job = self.jobs.get(job_id)
            if job is None:
                continue
            job.state = state
            agent.event("worker_job", job=job_id, state=state)
            if state == "RUNNING":
                log.info("worker job %s started: its workers join the job", job_id)
            if state in QUEUED:
                continue
            gone = [w for w in agent.live() if _of(job_id, w.node) and w.exit_code is None]
            for w in gone:  # the agent's next reaping takes them for lost (their node agent cannot report)
                w.exit_code = -signal.SIGKILL
            if gone or not job.cancelled:
                log.warning("worker job %s is ending (%s)%s", job_id, state,
                            f": {len(gone)} worker(s) leave the job" if gone else "")
            if state == "COMPLETING":
                continue  # its final state says whether it comes back
            del self.jobs[job_id]
            if job.releasing or job.cancelled or self.stopped:
                continue
            if state in AGAIN:
                log.warning("worker job %s ended %s: another one is submitted for its node", job_id, state)
            else:  # cancelled by someone, failed or done: given back; `elasticflow scale` grows the job again
                self.wanted -= 1
                if state != "CANCELLED":
                    log.warning("worker job %s ended %s; see %s/slurm/worker-%s.out", job_id, state,
                                self.run_dir, job_id)

    def rescale(self, agent, target: int):
        """`elasticflow scale TARGET`: worker jobs first. Returns the workers still to come from worker jobs
        (scaling.py counts them as present) or a refusal."""
        extra = target - self.own
        if extra > 0 and extra % self.per_node:
            return (f"{target} workers is not the allocation's {self.own} plus whole nodes of "
                    f"launcher.tasks_per_node={self.per_node}")
        self.wanted = min(self.most, max(0, math.ceil(extra / self.per_node)))
        live = sorted((j for j in self.jobs.values() if j.live), key=lambda j: int(j.job))
        surplus = len(live) - self.wanted
        queued = [j for j in live if j.state == "PENDING"]
        for job in (queued[::-1] + [j for j in live[::-1] if j.state != "PENDING"])[:max(0, surplus)]:
            job.releasing = True
            self._retire(agent, job)
        coming = 0
        for job in self.jobs.values():
            if job.live and job.state in QUEUED:
                coming += max(0, self.per_node - sum(_of(job.job, w.node) for w in agent.live()))
        return coming

    def _retire(self, agent, job: WorkerJob) -> None:
        """A scale-down's worker job: its workers leave at a step boundary (exit 5); then it is cancelled."""
        for w in [w for w in agent.members + agent.waiting if _of(job.job, w.node)]:
            agent.roster.move(w, "retiring")
            agent.dirty = True
        for w in [w for w in agent.admitted if _of(job.job, w.node)]:
            agent.roster.drop(w)
            w.signal(signal.SIGKILL)
        agent.event("worker_job", job=job.job, state="RELEASING")

    def _cancel(self, job: WorkerJob) -> None:
        job.cancelled = True
        self._orders.put(("cancel", job.job))

    def close(self, agent) -> None:
        """The job ends: cancel every worker job, queued or running, and wait (bounded) until SLURM took it."""
        self.stopped = True
        self._orders.put(("close", None))
        self._thread.join(CLOSE_S)

    def cancel_now(self) -> None:
        """From a signal handler (the job itself is being cancelled): a flag, no lock (the handler may have
        interrupted the loop inside a queue's); the thread reads it within POLL_S."""
        self.stopped = self.aborted = True

    # ------------------------------------------------------------------ SLURM (its own thread)
    def _slurm(self) -> None:
        known: Dict[str, str] = {}  # job id -> the state last reported
        next_poll = 0.0
        while True:
            try:
                order, value = self._orders.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                order, value = "poll", None
            if self.aborted:
                order = "close"
            if order == "submit":
                job = self._submit()
                if job is not None:
                    known[job] = "PENDING"
            elif order == "cancel":
                self._run("scancel", value)
            elif order == "close":
                # Every job of ours, including one submitted a moment ago and not yet answered.
                ids = set(known) | {row.split()[0] for row in self._queue()}
                if ids:
                    self._run("scancel", *sorted(ids))
                return
            if time.monotonic() >= next_poll or order == "poll":
                self._answers.put(("states", self._poll(known)))
                next_poll = time.monotonic() + POLL_S

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, env=_slurm_env(),
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(argv, 1, "", str(exc))

    def _submit(self) -> Optional[str]:
        sbatch = shutil.which("sbatch") or "sbatch"
        done = self._run(sbatch, "--parsable", str(self.script))
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            self._answers.put(("refused", said[-1] if said else f"sbatch exited {done.returncode}"))
            return None
        job = done.stdout.strip().split(";")[0]
        self._answers.put(("submitted", job))
        return job

    def _queue(self) -> List[str]:
        done = self._run("squeue", "-h", "-o", "%i %T", f"--name={self.name}")
        return done.stdout.splitlines() if done.returncode == 0 else []

    def _poll(self, known: Dict[str, str]) -> Dict[str, str]:
        """The worker jobs whose state changed since the last poll; an ended one is forgotten."""
        rows = dict(row.split()[:2] for row in self._queue() if len(row.split()) >= 2)
        changed = {}
        for job, last in list(known.items()):
            state = rows.get(job)
            if state is None:  # left the queue: its final state, while slurmctld still knows it
                info = self._run("scontrol", "show", "job", "-o", job).stdout
                state = next((f.split("=", 1)[1] for f in info.split() if f.startswith("JobState=")), "GONE")
            if state != last:
                changed[job] = known[job] = state
            if state not in QUEUED and state != "COMPLETING":
                del known[job]
        return changed


# ---------------------------------------------------------------------- the worker job's side
def join(run_dir: Path, run_job: str) -> Dict[str, Any]:
    """In a worker job: join this node to the run's agent, if it is still the one that submitted us."""
    from omegaconf import OmegaConf

    from ..config.schema import Config
    from ..distributed.comm import netif
    from ..distributed.agent.node_agent import NodeAgent

    try:
        agent = json.loads(protocol.agent_file(run_dir).read_text())
    except (OSError, ValueError):
        agent = {}
    if agent.get("job") != run_job:
        log.warning("the job that submitted this worker job has ended (no agent of run %s in %s): nothing to join",
                    run_job, run_dir)
        return {"joined": False}
    config = read_beneath(run_dir, (".elasticflow", "config.yaml")).decode()  # no symlink followed
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(config))
    cfg.launcher.procs_per_node = cfg.launcher.tasks_per_node  # the node agent starts this many
    token = (run_dir / ".elasticflow" / "token").read_text().strip()
    host = host_of(agent["address"])
    name = node_name(socket.gethostname(), os.environ.get("SLURM_JOB_ID", str(os.getpid())))
    return NodeAgent(cfg, agent["address"], token, srun_launch(cfg),
                     bind=netif.address_toward(host, cfg.launcher.interface), name=name).run()


def main(argv: Optional[List[str]] = None) -> None:
    """The worker job's entry: `python -m elasticflow.launchers.slurm_grow RUN_DIR RUN_JOB`."""
    from .exits import debug_requested, report

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if len(argv) != 2:
            raise ElasticFlowError("usage: python -m elasticflow.launchers.slurm_grow RUN_DIR RUN_JOB",
                                   "the agent writes this line into RUN_DIR/slurm/worker.sbatch; submit that")
        summary = join(Path(argv[0]).resolve(), argv[1])
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - one line, as in the CLI
        report(exc, debug_requested())
    print("done: " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)


if __name__ == "__main__":
    main()
