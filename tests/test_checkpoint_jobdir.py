"""One run per checkpoint job folder: two runs on one checkpoint.dir never touch each other's saves.

End to end (real `elasticflow train` processes): a second run started while the first trains writes a
folder of its own, and both keep every save they should; a SIGKILLed run resumes from its own folder
in the same run directory. In-process: a second run in the same run directory is refused, keep=N
prunes only the run's own folder, and another host's lease is judged by its age on the filesystem.
"""
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.checkpoint import jobdir
from elasticflow.checkpoint.format import temp_dirs
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer

from harness import REPO, SLOW, metrics, start, stop, train, wait_for  # SLOW: ~20 steps a second

EVERY = ["trainer.global_batch_size=8", "trainer.log_every=1", "checkpoint.interval.steps=5", "checkpoint.keep=2"]


def start_slow(model: Path, run: Path, shared: Path, *overrides: str):
    return start(run, f"checkpoint.dir={shared}", *EVERY, "trainer.max_steps=100000", *overrides, model=model,
                 common=["trainer.progress=false"])


def checkpoint_of(shared: Path, min_step: int):
    """The newest checkpoint under SHARED once it is of step MIN_STEP or later; None before."""
    newest = ckpt.latest(shared)
    return newest if newest is not None and ckpt.read_metadata(newest)["step"] >= min_step else None


def recorded(run: Path) -> str:
    return json.loads((run / ".elasticflow" / "checkpoint_job.json").read_text())["job"]


def steps_in(job: Path) -> list:
    return sorted(ckpt.read_metadata(p)["step"] for p in ckpt.complete_checkpoints(job))


def last_step(run: Path) -> int:
    return max(r["step"] for r in metrics(run) if "loss" in r)


# ---------------------------------------------------------------- end to end
def test_two_runs_on_one_checkpoint_dir_keep_their_own_saves(tmp_path):
    """Run A trains; run B (another run directory, the same model, checkpoint.dir and keep=2) starts and
    finishes meanwhile. Before: B adopted A's folder, removed A's save in flight, replaced its step
    checkpoints and pruned its own at once. Now each run's folder holds exactly its own newest two."""
    model, shared = SLOW, tmp_path / "shared"
    a, b = tmp_path / "a", tmp_path / "b"
    proc = start_slow(model, a, shared, "seed=1")
    try:
        wait_for(lambda: checkpoint_of(shared, 5), 120, "run A's checkpoint of step 5", proc=proc)
        out = train(model, b, f"checkpoint.dir={shared}", *EVERY, "seed=2", "trainer.max_steps=20")
        assert proc.poll() is None, "run A ended before run B finished: the runs did not overlap"
    finally:
        stderr_a = stop(proc, signal.SIGINT)
    assert proc.returncode == 130, stderr_a
    job_a, job_b = shared / recorded(a), shared / recorded(b)
    assert job_a != job_b and sorted(p.name for p in shared.iterdir()) == sorted([job_a.name, job_b.name])
    assert "resumed from" not in out.stderr and f"the newest job folder {job_a} is written by" in out.stderr
    # B: its two newest saves, nothing of A's
    assert steps_in(job_b) == [15, 20]
    assert {ckpt.read_metadata(p)["seed"] for p in ckpt.complete_checkpoints(job_b)} == {2}
    # A: the two newest of every save it made (every 5 steps, and the Ctrl-C save at its last step)
    last = last_step(a)
    assert steps_in(job_a) == sorted({*range(5, last + 1, 5), last})[-2:]
    assert {ckpt.read_metadata(p)["seed"] for p in ckpt.complete_checkpoints(job_a)} == {1}
    assert not list(temp_dirs(job_a)) and not list(temp_dirs(job_b))


def test_a_killed_run_resumes_from_its_own_folder(tmp_path):
    """SIGKILL leaves the run's lease behind; the same run directory started again takes its folder back
    at once (the dead pid is on this host) and resumes there, though another job's folder is newer."""
    model, shared, a = SLOW, tmp_path / "shared", tmp_path / "a"
    proc = start_slow(model, a, shared)
    try:
        wait_for(lambda: checkpoint_of(shared, 10), 120, "a checkpoint of step 10", proc=proc)
    finally:
        stop(proc, signal.SIGKILL)
    job_a = shared / recorded(a)
    assert [p.name for p in job_a.iterdir() if jobdir.HOLDER_RE.match(p.name)], "no lease left behind by SIGKILL"
    newest = ckpt.latest(job_a)
    train(model, tmp_path / "b", f"checkpoint.dir={shared}", *EVERY, "resume=none", "trainer.max_steps=5")
    assert ckpt.latest(shared).parent != job_a  # another job's folder is now the newest
    step = ckpt.read_metadata(newest)["step"]
    again = train(model, a, f"checkpoint.dir={shared}", *EVERY, f"trainer.max_steps={step + 5}", timeout=120)
    assert f"resumed from {newest}" in again.stderr and "waiting" not in again.stderr
    assert recorded(a) == job_a.name and ckpt.read_metadata(ckpt.latest(job_a))["step"] == step + 5


# ---------------------------------------------------------------- in-process
LINEAR = str(REPO / "models" / "linear.py")


def cfg_of(*overrides: str):
    return compose(LINEAR, ["trainer.progress=false", *overrides])


def test_a_second_run_in_the_same_run_directory_is_refused(tmp_path):
    cfg = cfg_of()
    first = ckpt.Checkpointer.for_run(tmp_path / "checkpoints", cfg, tmp_path)
    try:
        with pytest.raises(ElasticFlowError, match="this run directory is already in use by the run in") as err:
            ckpt.Checkpointer.for_run(tmp_path / "checkpoints", cfg, tmp_path)
        assert "hydra.run.dir" in err.value.hint
    finally:
        first.close()
    again = ckpt.Checkpointer.for_run(tmp_path / "checkpoints", cfg, tmp_path)  # free once the first closed
    assert again.job_dir == first.job_dir
    again.close()


STATE = {"W": np.arange(8, dtype=np.float32)}


def info(step: int) -> dict:
    return {"step": step, "cursor": {"epoch": 0, "samples_seen": step * 8}}


def test_keep_prunes_only_this_jobs_saves(tmp_path):
    """A live run's folder holds saves of later steps and one in flight; a second run with keep=2 prunes
    and tidies only its own folder."""
    shared = tmp_path / "shared"
    live = ckpt.Checkpointer.for_run(shared, cfg_of("checkpoint.keep=null"), tmp_path / "a")
    try:
        for step in (100, 200):
            live.save(f"step_{step}", STATE, info(step), wait=True)
        in_flight = live.job_dir / f".step_300.tmp-s300-{live.token}-g0.1"
        in_flight.mkdir()
        cfg = cfg_of(f"checkpoint.dir={shared}", "checkpoint.keep=2", "trainer.max_steps=6",
                     "checkpoint.interval.steps=2")
        other = ElasticTrainer(LINEAR, cfg, run_dir=str(tmp_path / "b"))
        other.fit()
        assert other.checkpoints.job_dir != live.job_dir
        assert steps_in(other.checkpoints.job_dir) == [4, 6]
        assert steps_in(live.job_dir) == [100, 200] and in_flight.is_dir()
    finally:
        live.close()


def test_keep_never_prunes_the_save_just_written(tmp_path):
    """Resumed from an earlier step of its folder, a run's new save sorts before the old later ones:
    keep=2 keeps it anyway (it used to be deleted by its own commit)."""
    job = tmp_path / "job_20250101-000000"
    ck = ckpt.Checkpointer(job, keep=2, asynchronous=False)
    for step in (190, 200, 110):
        ck.save(f"step_{step}", STATE, info(step))
    ck.close()
    assert steps_in(job) == [110, 190, 200]


def lease_of(job: Path, host: str, run_dir: str, age_s: float) -> Path:
    """A lease another host's process keeps (its pid cannot be checked from here), ``age_s`` old."""
    job.mkdir(parents=True, exist_ok=True)
    (job / jobdir.OWNER).write_text(json.dumps({"token": "feed", "run_dir": run_dir}))
    path = job / f".lease-feed-{host}-4242"
    path.write_text(json.dumps({"host": host, "pid": 4242, "token": "feed", "run_dir": run_dir}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_another_hosts_lease_is_live_until_it_ages(tmp_path, monkeypatch, caplog):
    shared, run = tmp_path / "shared", tmp_path / "run"
    job = shared / "linear_20250101-000000"
    lease_of(job, "elsewhere", "/other/run", age_s=0)
    name, reserved = jobdir.choose(shared, "linear", run / ".elasticflow", run, fresh=False, explicit=False)
    assert name != job.name and reserved  # written by a live run on another host: not adopted
    lease_of(job, "elsewhere", "/other/run", age_s=2 * jobdir.LEASE_S)
    assert jobdir.live_owner(job) is None  # its last beat is older than the lease: that run is gone
    # The same run directory restarted on this host while its old host's lease still runs: it waits
    # for the lease to lapse (a restart after a crash elsewhere), then takes the folder over.
    monkeypatch.setattr(jobdir, "LEASE_S", 1.0)
    monkeypatch.setattr(jobdir, "BEAT_S", 0.2)
    old = lease_of(job, "elsewhere", str(run), age_s=0)
    with caplog.at_level(logging.WARNING, logger="elasticflow"):
        lease = jobdir.hold(job, run, "cafe", wait_s=10)  # returns (no error) only once the lease lapsed
    try:
        assert "waiting up to 10 s for the lease of" in caplog.text  # it waited: not taken over at once
        assert json.loads((job / jobdir.OWNER).read_text())["token"] == "cafe" and not old.exists()
    finally:
        lease.release()
    lease_of(job, "elsewhere", "/other/run", age_s=0)
    with pytest.raises(ElasticFlowError, match="it is written by the run in /other/run .pid 4242 on elsewhere"):
        jobdir.hold(job, run, "cafe", wait_s=10)  # another run's: refused at once, no waiting


def test_an_unreadable_owner_record_does_not_lock_the_folder_forever(tmp_path):
    job = tmp_path / "linear_20250101-000000"
    job.mkdir()
    (job / jobdir.OWNER).write_text("not json")
    lease = jobdir.hold(job, tmp_path / "run", "cafe", wait_s=1)
    try:
        assert json.loads((job / jobdir.OWNER).read_text())["token"] == "cafe"
    finally:
        lease.release()
