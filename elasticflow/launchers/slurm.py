"""The SLURM launcher: submit a batch job, or use the allocation we are in.

Outside an allocation, `elasticflow train ... launcher=slurm` writes RUN_DIR/slurm/job.sbatch and submits
it. The batch script runs the agent on the first node of the allocation (`python -m
elasticflow.launchers.slurm RUN_DIR`); the agent hosts the store on that node's address and starts each
worker as its own `srun --exact` job step, so one task's death ends only its step; with
``launcher.gpus_per_node`` each step binds one GPU of its own (see srun_launch). Inside an allocation
(an salloc shell, or your own batch script) the same agent runs in place of a submission.

Preemption and time limits: the job asks for a warning signal (``launcher.signal``, USR1 90 s before the
end). On it the workers checkpoint at the next step boundary, and the agent requeues the job
(`scontrol requeue`); the requeued job resumes from that checkpoint in the same run directory.

Why a hand-written script and not submitit: our layout is an agent in the batch shell plus one step per
worker, which submitit's single `srun` of a pickled function does not express; it also has no way to
write a script without submitting (``launcher.submit=false``) and polls job state with sacct.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from omegaconf import OmegaConf

from ..distributed import protocol
from .._util.paths import read_beneath
from ..errors import ElasticFlowError, TrainingInterrupted
from .slurm_jobs import resources, sbatch_lines, srun_launch

log = logging.getLogger("elasticflow")


def where() -> str:
    """'step' inside an srun step, 'allocation' in a batch script or salloc shell, else 'outside'.

    An interactive shell on a login node has no SLURM_JOB_ID, so it is never mistaken for a job.
    """
    if os.environ.get("SLURM_STEP_ID") is not None and os.environ.get("SLURM_JOB_ID"):
        return "step"
    return "allocation" if os.environ.get("SLURM_JOB_ID") else "outside"


def total_workers(cfg: Any) -> int:
    return cfg.launcher.nodes * cfg.launcher.tasks_per_node


def batch_script(cfg: Any, run_dir: Path) -> str:
    """The sbatch script: directives from launcher.*, then the agent exec'd on the first node."""
    lc = cfg.launcher
    name = f"elasticflow-{Path(cfg.model).stem}"
    directives = [f"--job-name={name}", f"--nodes={lc.nodes}", f"--ntasks-per-node={lc.tasks_per_node}",
                  f"--signal=B:{lc.signal}", "--requeue" if lc.requeue else "--no-requeue",
                  # A node that fails takes only its own steps (workers) with it: without --no-kill SLURM
                  # ends the whole job once the node is DOWN (and requeues it, from the last checkpoint),
                  # while the agent on the first node would have gone on with the workers left.
                  "--no-kill",
                  # A requeued job must append to the log, not truncate the first run's.
                  "--open-mode=append", f"--output={run_dir}/slurm/job-%j.out"]
    directives += resources(lc)
    lines = sbatch_lines(directives) + [
        "# Written by elasticflow. The agent runs on the first node and starts every worker as its own",
        "# `srun --exact` step; the run directory below is fixed, so a requeued job resumes from it.",
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"exec {shlex.quote(sys.executable)} -m elasticflow.launchers.slurm {shlex.quote(str(run_dir))}",
    ]
    return "\n".join(lines) + "\n"


def run_in_allocation(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    """The agent, here, with workers as srun steps; requeues the job after a preemption warning."""
    from ..distributed.agent.agent import Agent
    from ..distributed.comm.netif import address_of
    from ..observability.goodput import job
    from .._util.envnames import ENV_RUN_DIR_ID
    from .._util.paths import identity

    lc = cfg.launcher
    lc.workers = total_workers(cfg)
    # Each srun step reads config.yaml only from the run directory checked here (worker._read_config): by its
    # inode, which a shared filesystem keeps from host to host
    agent = Agent(cfg, run_dir, host=address_of(lc.interface), launch=srun_launch(cfg),
                  worker_env={protocol.ENV_BIND: "auto", ENV_RUN_DIR_ID: identity(run_dir, across_hosts=True)})
    previous = signal.getsignal(signal.SIGTERM)
    if lc.max_nodes and lc.max_nodes > lc.nodes:  # grow into nodes SLURM frees (slurm_grow.py)
        from .slurm_grow import WorkerJobs

        lc.max_workers = min(lc.max_workers or lc.max_nodes * lc.tasks_per_node, lc.max_nodes * lc.tasks_per_node)
        agent.capacity = WorkerJobs(cfg, run_dir, agent.state.job)

        def cancelled(signum, frame):  # scancel of this job: SIGTERM, then SIGKILL after KillWait
            agent.capacity.cancel_now()
            signal.signal(signal.SIGTERM, previous)

        signal.signal(signal.SIGTERM, cancelled)
    try:
        with job(run_dir):  # the job's start and end, for the goodput ledger (a requeue starts another)
            return agent.run()
    except TrainingInterrupted:
        if not agent.state.preempted or not cfg.launcher.requeue:
            raise
        job = os.environ["SLURM_JOB_ID"]
        # Said before the command: SLURM may kill this batch step as it requeues it, before a line after it.
        log.warning("preempted: checkpoint written; requeueing job %s (the requeued job resumes in %s)", job, run_dir)
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if done.returncode != 0:
            raise ElasticFlowError(f"checkpoint written, but `scontrol requeue {job}` failed: {done.stderr.strip()}",
                                   "resubmit the job script by hand; it resumes from the checkpoint") from None
        return {"requeued": job, "run_dir": str(run_dir)}
    finally:
        signal.signal(signal.SIGTERM, previous)


def submit(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    """Write RUN_DIR/slurm/job.sbatch (and the resolved config); sbatch it unless launcher.submit=false."""
    state = run_dir / ".elasticflow"
    state.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, state / "config.yaml", resolve=True)
    script = run_dir / "slurm" / "job.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(batch_script(cfg, run_dir))
    if not cfg.launcher.submit:
        print(f"wrote {script}; submit it with: sbatch {script}", flush=True)
        return {"script": str(script), "run_dir": str(run_dir)}
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ElasticFlowError("sbatch is not on PATH, so the job cannot be submitted",
                               f"run on a SLURM login node, or pass launcher.submit=false to only write {script}")
    # A submission from inside another job must not inherit that job's SLURM_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ElasticFlowError(f"sbatch refused the job: {done.stderr.strip()}",
                               f"check launcher.partition/time/account; the script is {script}")
    job = done.stdout.strip().split(";")[0]
    (run_dir / "slurm" / "job_id").write_text(job + "\n")
    print(f"submitted job {job}; run directory {run_dir}", flush=True)
    return {"job_id": job, "run_dir": str(run_dir)}


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    place = where()
    if place == "step":
        raise ElasticFlowError("`elasticflow train` is running inside an srun step; every task would start "
                               "its own job", "run it once from the batch script or the salloc shell, not under srun")
    if place == "allocation":
        return run_in_allocation(cfg, run_dir)
    return submit(cfg, run_dir)


def main(argv: List[str] | None = None) -> None:
    """The batch script's entry: `python -m elasticflow.launchers.slurm RUN_DIR`."""
    from ..config.schema import Config
    from .exits import debug_requested, print_done, report

    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0]).resolve()
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(run_dir / "train.log")])
    try:
        config = read_beneath(run_dir, (".elasticflow", "config.yaml")).decode()  # no symlink followed
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(config))
        # No validate() here, although this is a process entry point: the file is the config that
        # `elasticflow train` validated (cli._train_task) before submit() wrote it (after a requeue, the
        # agent's re-save of it), like the workers' copy. The merge into the schema still refuses unknown
        # keys and wrong types; the values set below and in run_in_allocation are valid by construction.
        if os.environ.get("SLURM_RESTART_COUNT"):  # a requeued job always continues where it stopped
            cfg.resume = "auto"
        summary = run_in_allocation(cfg, run_dir)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - one line, as in the CLI
        report(exc, debug_requested())
    print_done(summary, run_dir)


if __name__ == "__main__":
    main()
