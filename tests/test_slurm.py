"""launcher=slurm against a real SLURM cluster on this machine (tests/slurm_cluster.py starts it).

Skipped, with the reason, where SLURM cannot be started (not root, no apt).
"""
import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import ELASTICFLOW, metrics, run_cli
from slurm_cluster import slurm, slurm_cluster  # noqa: F401 - fixtures
from test_elastic import COMMON, PROBE, assert_equivalent, logged_step, reference, wait_for  # noqa: F401

from elasticflow.launchers import slurm as slurm_launcher


def submit(run: Path, *overrides: str, env: dict | None = None) -> int:
    """`elasticflow train PROBE launcher=slurm ...` from outside any allocation; returns the job id."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    proc = subprocess.run(ELASTICFLOW + ["train", str(PROBE), "launcher=slurm", f"hydra.run.dir={run}", *COMMON,
                                         *overrides], env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = int((run / "slurm" / "job_id").read_text())
    assert f"submitted job {job}; run directory {run}" in proc.stdout
    return job


def job_log(run: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run / "slurm").glob("job-*.out")))


def test_submit_false_writes_a_batch_script(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(["train", PROBE, "launcher=slurm", f"hydra.run.dir={run}", "launcher.nodes=2",
                    "launcher.tasks_per_node=4", "launcher.partition=gpu", "launcher.time=01:30:00",
                    "launcher.cpus_per_task=2", "launcher.gpus_per_node=1", "launcher.submit=false",
                    "launcher.sbatch_args=['--qos=high']"], check=True)
    script = (run / "slurm" / "job.sbatch").read_text()
    assert f"wrote {run}/slurm/job.sbatch" in proc.stdout
    for directive in ("--nodes=2", "--ntasks-per-node=4", "--partition=gpu", "--time=01:30:00", "--cpus-per-task=2",
                      "--gpus-per-node=1", "--signal=B:USR1@90", "--requeue", "--open-mode=append",
                      f"--output={run}/slurm/job-%j.out", "--qos=high", "--job-name=elasticflow-digits_probe"):
        assert f"#SBATCH {directive}\n" in script, directive
    assert script.startswith("#!/bin/bash\n")
    assert f"-m elasticflow.launchers.slurm {run}" in script.splitlines()[-1]
    assert not (run / "slurm" / "job_id").exists()
    assert (run / ".elasticflow" / "config.yaml").is_file() and (run / ".hydra").is_dir()
    no_requeue = run_cli(["train", PROBE, "launcher=slurm", f"hydra.run.dir={tmp_path / 'b'}", "launcher.submit=false",
                          "launcher.requeue=false", "launcher.signal=USR2@300"], check=True)
    assert no_requeue.returncode == 0
    text = (tmp_path / "b" / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --no-requeue\n" in text and "#SBATCH --signal=B:USR2@300\n" in text


def test_where_tells_a_login_shell_from_an_allocation_and_a_step(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    assert slurm_launcher.where() == "outside"
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert slurm_launcher.where() == "allocation"
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert slurm_launcher.where() == "step"


def test_three_tasks_match_a_single_local_worker(slurm, tmp_path, reference):
    run = tmp_path / "run"
    job = submit(run, "launcher.tasks_per_node=3")
    info = slurm.wait_done(job, timeout=300)
    assert info["JobState"] == "COMPLETED", job_log(run)
    assert {r["world_size"] for r in metrics(run) if "loss" in r} == {3}
    assert_equivalent(run, reference)


def test_a_killed_task_does_not_end_the_job(slurm, tmp_path, reference):
    run = tmp_path / "run"
    job = submit(run, "launcher.tasks_per_node=3", env={"EF_PROBE_KILL": "1:20:forward"})
    info = slurm.wait_done(job, timeout=300)
    assert info["JobState"] == "COMPLETED", job_log(run)
    sizes = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert sizes[0] == 3 and sizes[-1] == 2
    assert_equivalent(run, reference)


def test_preemption_checkpoints_requeues_and_resumes(slurm, tmp_path, reference):
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    job = submit(run, "launcher.tasks_per_node=2", env={"EF_PROBE_SLEEP": "0.05", "EF_PROBE_RECORD": str(record)})
    wait_for(lambda: logged_step(run) >= 15, 240, "step 15")
    slurm.signal(job, "USR1", batch=True)  # what SLURM sends launcher.signal's seconds before the end
    slurm.requeue_now(job, timeout=120)    # test-only: skip SLURM's 120 s hold on a requeued job
    info = slurm.wait_done(job, timeout=300)
    assert info["JobState"] == "COMPLETED", job_log(run)
    assert int(info.get("Restarts", 0)) >= 1
    log = job_log(run)
    assert "requeued" in log
    assert_equivalent(run, reference)
    # Exactly once across the requeue: each committed step's ids, from the run that committed it.
    committed = {r["step"]: r["generation"] for r in metrics(run) if "loss" in r}
    consumed = Counter()
    for f in record.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if committed.get(r["step"]) == r["generation"] and r["epoch"] == 0:
                consumed.update(r["ids"])
    assert consumed == Counter(range(1437))
    events = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "preempt" in events and events.count("started") == 2


def test_inside_an_allocation_uses_it_instead_of_submitting(slurm, tmp_path, reference):
    run = tmp_path / "run"
    proc = slurm.run("salloc", "-N1", "-n2", *ELASTICFLOW, "train", str(PROBE), "launcher=slurm",
                     f"hydra.run.dir={run}", *COMMON, "launcher.tasks_per_node=2", timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted job" not in proc.stdout and not (run / "slurm" / "job_id").exists()
    assert {r["world_size"] for r in metrics(run) if "loss" in r} == {2}
    assert_equivalent(run, reference)
