"""A save whose commit needed the agent's store, finished from its files (elasticflow/checkpoint/finish.py), in
process: three writers of one save (replicated state), whose store fails after each has written its shard. The
job-level test, a 3-worker sharded job whose agent is killed before its last save, is
tests/test_shard_checkpoint.py's test_a_save_the_store_could_not_commit_is_committed_from_its_files_and_resumed."""
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.checkpoint import Checkpointer, Coordinator
from elasticflow.checkpoint.finish import commit_run, finish_pending, survey
from elasticflow.errors import ElasticFlowError
from harness import cli, flip_a_byte

STATE = {"hidden/W": np.arange(60, dtype=np.float32).reshape(6, 10), "out/b": np.ones(3, np.float32),
         "step_count": np.array([7], np.int64)}


def info(step):
    return {"step": step, "cursor": {"epoch": 0, "samples_in_epoch": 64 * step, "samples_seen": 64 * step}}


class StoreGone(Coordinator):
    """The agent's store, unreachable once the shards are on disk."""

    def report(self, key, rank, value):
        raise ConnectionError("Connection reset by peer")

    def collect(self, key, world, timeout_s, gone=None):
        raise ConnectionError("Connection reset by peer")


def save_without_store(job, step, token="0a1b2c3d", together=False):
    """Every rank of 3 writes its shard of ``step``; the store fails as each reports. ``together``: at once, so rank 0
    finds the others' files while it waits and commits the save itself; else rank 0 first, which gives up waiting
    for them (0.2 s), then the others: a save left for the command or the next start."""
    writers = [Checkpointer(job, asynchronous=False, coordinator=StoreGone(), token=token,
                            timeout_s=30 if together else 0.2) for _ in range(3)]

    def write(r):
        return writers[r].save(f"step_{step}", STATE, info(step), rank=r, world=3, wait=True)

    if together:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(write, range(3)))
    else:
        for r in range(3):
            write(r)
    for w in writers:
        w.close()


@pytest.fixture
def job(tmp_path, caplog):
    job = tmp_path / "ckpts" / "probe_20261207-120000"
    ckpt.save(job, "step_5", {k: v * 0 for k, v in STATE.items()}, info(5))  # the newest that committed
    with caplog.at_level(logging.WARNING, "elasticflow"):
        save_without_store(job, 9)
    assert "checkpoint step_9 not committed: rank 0 could not report its shard" in caplog.text
    assert f"`elasticflow checkpoint commit {job}` commits it from them" in caplog.text
    return job


def test_rank_0_commits_a_save_whose_store_failed_from_its_files_once_all_are_there(tmp_path, caplog):
    """The store lost at a save (the agent's host gone, its door held shut): every rank still writes its shard and
    report, and rank 0 commits the save from them before it goes on (or exits), so no trained state is lost."""
    job = tmp_path / "ckpts" / "probe_20261207-120000"
    with caplog.at_level(logging.WARNING, "elasticflow"):
        save_without_store(job, 9, together=True)
    assert f"checkpoint {job / 'step_9'} committed from its 3 shard files: the agent's store could not be " \
           "reached" in caplog.text
    assert [p.name for p in ckpt.complete_checkpoints(job)] == ["step_9"] and not survey(job)
    loaded = ckpt.load(job / "step_9")
    assert all(np.array_equal(loaded[k], v) for k, v in STATE.items())


def test_a_save_whose_store_failed_is_committed_from_its_files(job):
    assert [p.name for p in ckpt.complete_checkpoints(job)] == ["step_5"]
    assert commit_run(job) == f"committed {job / 'step_9'} from its 3 shard files (step 9)"
    meta = ckpt.read_metadata(job / "step_9")
    assert meta["step"] == 9 and meta["writers"] == 3 and sorted(meta["files"]) == [ckpt.shard_name(r, 3)
                                                                                     for r in range(3)]
    assert sorted(p.name for p in (job / "step_9").iterdir()) == ["COMMIT", "metadata.json",
                                                                 *(ckpt.shard_name(r, 3) for r in range(3))]
    loaded = ckpt.load(job / "step_9")
    assert all(np.array_equal(loaded[k], v) for k, v in STATE.items())
    assert commit_run(job) == f"nothing to commit in {job}: no save newer than its newest checkpoint (step_9) " \
                              "is waiting for its commit"


def test_a_save_missing_a_report_is_refused_naming_it_and_an_older_one_is_never_taken(job):
    next(job.glob(".step_9.tmp-*")).joinpath("report-00002-of-00003.json").unlink()
    with pytest.raises(ElasticFlowError, match=r"step_9 .* cannot be committed: the shard of rank 2 of 3 is missing "
                                               r"or incomplete \(shard-00002-of-00003.safetensors\); a partial set"):
        commit_run(job)
    assert [p.name for p in ckpt.complete_checkpoints(job)] == ["step_5"]
    save_without_store(job, 4, token="77aa77aa")  # whole, but older than the newest checkpoint: left alone
    assert [p.name for p in survey(job)] == ["step_9"]


def test_a_running_runs_own_saves_are_never_taken(job):
    """A worker that joins a running job resumes too: the saves of the run it joins may be in flight."""
    assert finish_pending(job, "0a1b2c3d", 5) is None
    assert [p.name for p in ckpt.complete_checkpoints(job)] == ["step_5"]
    assert finish_pending(job, "99", 5) == job / "step_9"


def test_the_workers_of_a_start_finish_it_together_one_committing_and_a_changed_byte_is_refused(job, tmp_path):
    """Every worker of a resume=auto start calls finish_pending at once: one commits, the others wait for it (and a
    worker of a later start finds nothing left). A shard whose bytes are not those its writer hashed is refused in one
    line, never committed."""
    flipped = tmp_path / "flipped" / job.name
    shutil.copytree(job, flipped)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda _: finish_pending(job, "f00d", 10), range(3)))
    assert sorted(map(str, got)) == [str(job / "step_9"), "None", "None"], got
    assert finish_pending(job, "beef", 10) is None
    flip_a_byte(next(flipped.glob(".step_9.tmp-*")) / ckpt.shard_name(2, 3))
    refused = cli(["checkpoint", "commit", flipped])
    assert refused.returncode != 0 and "is corrupt: its bytes do not hash to the checksums its writer reported" in \
        refused.stderr, refused.stderr
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == \
        [refused.stderr.splitlines()[0]], refused.stderr
    assert ckpt.latest(flipped).name == "step_5"


@pytest.mark.parametrize("args", [["checkpoint"], ["checkpoint", "comit", "runs/a"], ["checkpoint", "commit"]])
def test_a_bad_checkpoint_command_is_one_error_line_with_a_hint(args):
    out = cli(args)
    assert out.returncode != 0 and out.stderr.splitlines() == [
        f"error: checkpoint takes `commit RUN_DIR`, got {' '.join(args[1:]) or 'nothing'}",
        "hint: e.g. elasticflow checkpoint commit outputs/2026-11-22/10-00-00: commits the run's last save once "
        "every worker's shard of it is on disk"], out.stderr
