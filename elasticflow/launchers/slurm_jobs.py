"""What every SLURM job of a run shares: the sbatch directives of its resources, the script's first lines,
and how a worker starts as its own srun step (the agent's job, slurm.py, and worker jobs, slurm_grow.py)."""
from __future__ import annotations

import shutil
import subprocess
from typing import Any, Dict, List

from ..config.ranges import has_control_characters
from ..distributed import protocol
from ..errors import ElasticFlowError
from .worker import COMMAND


def resources(lc: Any) -> List[str]:
    """The directives every job of the run shares (the agent's, and worker jobs: slurm_grow.py)."""
    directives = []
    for key, flag in (("partition", "partition"), ("time", "time"), ("cpus_per_task", "cpus-per-task"),
                      ("gpus_per_node", "gpus-per-node"), ("account", "account")):
        if lc[key] is not None:
            directives.append(f"--{flag}={lc[key]}")
    return directives + list(lc.sbatch_args)


def sbatch_lines(directives: List[str]) -> List[str]:
    """The script's first lines; refuses a directive with a newline (it would end the #SBATCH block)."""
    # validate() keeps launcher.* on one line, but not the run directory (hydra.run.dir is no config key).
    for directive in directives:
        if has_control_characters(directive):
            raise ElasticFlowError(f"the job.sbatch directive {directive!r} would hold a newline or control "
                                   "character", "pass hydra.run.dir and launcher.* values on one line")
    return ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives]


def srun_launch(cfg: Any):
    """Start one worker as its own job step of the current allocation."""
    srun = shutil.which("srun")
    if srun is None:
        raise ElasticFlowError("srun is not on PATH inside the SLURM allocation",
                               "load your cluster's SLURM module in the batch script")

    def launch(env: Dict[str, str]) -> subprocess.Popen:
        cmd = [srun, "--exact", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=0",
               f"--job-name=worker-{env[protocol.ENV_WORKER_ID]}"]
        if cfg.launcher.cpus_per_task:
            cmd.append(f"--cpus-per-task={cfg.launcher.cpus_per_task}")
        if cfg.launcher.gpus_per_node:
            # One GPU of the node's launcher.gpus_per_node, held by this step alone until it ends: a
            # concurrent step takes another, a replacement the one its predecessor freed. Per task, not
            # --gpus=1 (a count for the whole step): --gpus-per-task also binds the task to it
            # (--tres-bind=gres/gpu:per_task:1), so CUDA_VISIBLE_DEVICES names that one GPU and the
            # worker takes cuda:0 (devices.resolve). Binding by SLURM_LOCALID or --gpu-bind=single:1
            # cannot spread workers: each worker is the only task of its own step, so SLURM_LOCALID is 0
            # everywhere and the binding chooses only among the GPUs the step already holds.
            cmd.append("--gpus-per-task=1")
        cmd += COMMAND
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    return launch
