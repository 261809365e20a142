"""launcher=slurm against a real SLURM cluster on this machine (tests/slurm_cluster.py starts it).

Skipped, with the reason, where SLURM cannot be started (not root, no apt). The tests of the generated
script, the srun command line, each task's GPU placement and the GPU settings' validation need no cluster.
"""
import os
import subprocess
from pathlib import Path

import pytest

from harness import (COMMON, ELASTICFLOW, PROBE, assert_each_sample_once, assert_equivalent, events, job_log,
                     logged_step, metrics, run_cli, wait_for)
from slurm_cluster import slurm, slurm_cluster  # noqa: F401 - fixtures

from elasticflow.config import devices
from elasticflow.config.schema import compose
from elasticflow.distributed import protocol
from elasticflow.errors import ElasticFlowError
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


def test_submit_false_writes_a_batch_script(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(["train", PROBE, "launcher=slurm", f"hydra.run.dir={run}", "launcher.nodes=2",
                    "launcher.tasks_per_node=4", "launcher.partition=gpu", "launcher.time=01:30:00",
                    "launcher.cpus_per_task=2", "launcher.gpus_per_node=4", "launcher.submit=false",
                    "launcher.sbatch_args=['--qos=high']"], check=True)
    script = (run / "slurm" / "job.sbatch").read_text()
    assert f"wrote {run}/slurm/job.sbatch" in proc.stdout
    for directive in ("--nodes=2", "--ntasks-per-node=4", "--partition=gpu", "--time=01:30:00", "--cpus-per-task=2",
                      "--gpus-per-node=4", "--signal=B:USR1@90", "--requeue", "--no-kill", "--open-mode=append",
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


GPU_JOB = ["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=4", "launcher.gpus_per_node=4",
           "trainer.device=cuda", "trainer.precision=bf16", "comm.backend=auto"]


def test_a_gpu_job_asks_for_gpus_per_node_and_binds_one_gpu_per_worker_step(tmp_path, monkeypatch):
    cfg = compose(str(PROBE), GPU_JOB)
    script = slurm_launcher.batch_script(cfg, tmp_path)
    assert "#SBATCH --gpus-per-node=4\n" in script and "--gpus-per-task" not in script
    # srun_launch starts the real command line; a stand-in srun writes down what it was given.
    (tmp_path / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$EF_TEST_ARGV"\n')
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    argv = tmp_path / "argv"
    proc = slurm_launcher.srun_launch(cfg)({protocol.ENV_WORKER_ID: "3", "EF_TEST_ARGV": str(argv)})
    assert proc.wait(timeout=30) == 0
    args = argv.read_text().splitlines()
    assert args[:6] == ["--exact", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=0", "--job-name=worker-3",
                        "--gpus-per-task=1"]
    assert not any(a.startswith(("--gpus=", "--gpu-bind", "--gres")) for a in args)
    assert args[-2:] == ["-m", "elasticflow.launchers.worker"]


class FakeCuda:
    """What the backend reports in a process whose CUDA_VISIBLE_DEVICES is ``env``'s."""

    def __init__(self, env: dict):
        self.visible = [i for i in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if i]

    def gpus(self):
        return ["NVIDIA A100"] * len(self.visible)

    def bf16_supported(self):
        return True


@pytest.mark.parametrize("cgroup", [True, False], ids=["devices-constrained", "unconstrained"])
def test_each_of_four_tasks_on_a_four_gpu_node_takes_its_own_gpu_as_cuda_0_with_nccl(cgroup):
    """What srun (--gpus-per-task=1) gives task k: a step of its own, SLURM_LOCALID 0 (the step's only
    task), the GPU SLURM picked in SLURM_STEP_GPUS, and CUDA_VISIBLE_DEVICES naming only it (renumbered
    from 0 where cgroups constrain devices). The agent's slot is k, as the agent numbers its workers."""
    cfg = compose(str(PROBE), GPU_JOB)
    for k in range(4):
        env = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": str(k), "SLURM_STEP_GPUS": str(k), "SLURM_LOCALID": "0",
               "CUDA_VISIBLE_DEVICES": "0" if cgroup else str(k), protocol.ENV_LOCAL_SLOT: str(k),
               protocol.ENV_LOCAL_WORKERS: "4"}
        placement = devices.resolve(cfg, FakeCuda(env), local_workers=4, env=env)
        assert placement == devices.Placement("cuda:0", "bf16", "nccl", "NVIDIA A100"), (k, placement)
        assert placement.describe() == "cuda:0 (NVIDIA A100), bf16 mixed, nccl"


@pytest.mark.parametrize("overrides, message", [
    (["launcher.tasks_per_node=4", "launcher.gpus_per_node=2", "comm.backend=nccl"],
     "launcher.tasks_per_node=4 is more than launcher.gpus_per_node=2: NCCL cannot put two workers on one GPU "
     "(hint: pass launcher.tasks_per_node=2, or launcher.gpus_per_node=4)"),
    (["launcher.tasks_per_node=3", "launcher.gpus_per_node=2"],
     "launcher.tasks_per_node=3 is more than launcher.gpus_per_node=2: each worker's srun step takes a GPU of its "
     "own, so 1 per node would wait"),
    (["launcher.gpus_per_node=0"], "launcher.gpus_per_node must be a positive integer, got 0"),
    (["launcher.gpus_per_node=-1"], "launcher.gpus_per_node must be a positive integer, got -1"),
    (["trainer.device=cuda"], "trainer.device=cuda with launcher=slurm but launcher.gpus_per_node is not set, so "
     "the job would be given no GPU (hint: pass launcher.gpus_per_node=N"),
])
def test_gpu_settings_the_job_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ElasticFlowError) as info:
        compose(str(PROBE), ["launcher=slurm", *overrides])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_gpu_settings_a_job_can_honour_pass():
    assert compose(str(PROBE), ["launcher=slurm", "launcher.tasks_per_node=4", "launcher.gpus_per_node=4",
                                "comm.backend=nccl", "trainer.device=cuda"]).launcher.gpus_per_node == 4
    # gpus_per_node is a SLURM key: a local run ignores it, and trainer.device=cuda there needs no launcher key.
    assert compose(str(PROBE), ["trainer.device=cuda"]).launcher.gpus_per_node is None


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
    assert "preempted: checkpoint written; requeueing job" in log
    assert_equivalent(run, reference)
    # Exactly once across the requeue: each committed step's ids, from the run that committed it.
    assert_each_sample_once(run, record)
    kinds = [e["event"] for e in events(run)]
    assert "preempt" in kinds and kinds.count("started") == 2


def test_inside_an_allocation_uses_it_instead_of_submitting(slurm, tmp_path, reference):
    run = tmp_path / "run"
    proc = slurm.run("salloc", "-N1", "-n2", *ELASTICFLOW, "train", str(PROBE), "launcher=slurm",
                     f"hydra.run.dir={run}", *COMMON, "launcher.tasks_per_node=2", timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted job" not in proc.stdout and not (run / "slurm" / "job_id").exists()
    assert {r["world_size"] for r in metrics(run) if "loss" in r} == {2}
    assert_equivalent(run, reference)
