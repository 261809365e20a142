"""The local SLURM cluster fixture works: batch jobs run, steps share an allocation, requeue restarts a job.
Skipped (with the reason) where SLURM cannot be started, e.g. not root."""
from __future__ import annotations

import re

from slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)


def test_sbatch_hostname_completes(slurm, tmp_path):
    out = tmp_path / "hostname.out"
    jobid = slurm.sbatch_wrap("hostname; echo job=$SLURM_JOB_ID nodes=$SLURM_JOB_NUM_NODES", "-o", str(out),
                              cwd=tmp_path)
    info = slurm.wait_done(jobid, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    assert info["ExitCode"] == "0:0", info
    text = out.read_text()
    assert f"job={jobid} nodes=1" in text
    assert slurm.jobcomp(jobid).get("JobState") == "COMPLETED"


def test_exact_steps_run_concurrently_in_one_allocation(slurm, tmp_path):
    # Two one-task steps of a two-task job: with --exact each takes one CPU, so both run at once
    # (without --exact the first step takes the whole allocation and the second waits for it).
    script = f"""#!/bin/bash
#SBATCH -N 1 -n 2
#SBATCH -o {tmp_path}/job.out
for w in a b; do
  srun --exact -n1 bash -c "touch {tmp_path}/started-\\$SLURM_STEP_ID; \
    for i in \\$(seq 100); do [ \\$(ls {tmp_path}/started-* | wc -l) -ge 2 ] && break; sleep 0.1; done; \
    echo step \\$SLURM_STEP_ID saw \\$(ls {tmp_path}/started-* | wc -l)" &
done
wait
"""
    jobid = slurm.sbatch(script, cwd=tmp_path)
    info = slurm.wait_done(jobid, timeout=60)
    assert info["JobState"] == "COMPLETED", (info, slurm.log_tail())
    lines = sorted(re.findall(r"step (\d+) saw (\d+)", (tmp_path / "job.out").read_text()))
    assert lines == [("0", "2"), ("1", "2")], (tmp_path / "job.out").read_text()


def test_requeue_now_restarts_a_running_job(slurm, tmp_path):
    out = tmp_path / "rq.out"
    jobid = slurm.submit_and_wait(
        "#!/bin/bash\necho run restart=${SLURM_RESTART_COUNT:-0}\nsleep 300\n",
        "-o", str(out), "--open-mode=append", state="RUNNING", cwd=tmp_path)
    slurm.wait_file(out, "run restart=0", timeout=30)
    slurm.requeue(jobid)
    slurm.requeue_now(jobid)
    slurm.wait_file(out, "run restart=1", timeout=30)
    assert slurm.job_info(jobid)["Restarts"] == "1"
