"""Sharded, asynchronous, resharding checkpoints: save with N workers, resume with M, lose nothing.

End to end (real CLI processes): 4 workers save, 1/2/3 resume and end equal to the uninterrupted
1-worker run (harness.assert_equivalent) with every sample consumed exactly once; SIGKILLs at
every phase of a save leave the previous checkpoint loadable; corrupt, truncated, missing and
incompatible checkpoints give one clear error line or the resume=auto fallback. The checkpoint
module's own behaviour (plan, checksums, async snapshot, failures) is tested in-process.
"""
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.checkpoint.format import file_checksum, plan, specs_of
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer

from harness import (PROBE, REPO, STEPS, assert_each_sample_once, assert_equivalent, cli, events, finish,
                     flip_a_byte, metrics, run_cli, saved, start, train_ok)

SAVE_EVERY = ["checkpoint.interval.steps=10", "checkpoint.keep=null"]


def leftovers(run_dir: Path) -> list:
    return [p.name for p in (run_dir / "checkpoints").rglob(".*") if p.is_dir()]


def assert_exactly_once(run_dir: Path, record: Path, steps: int = STEPS) -> None:
    """Every step committed once, and per epoch the sample ids that went into committed steps each once.

    A step's ids count from the attempt whose (run, generation) committed it: records carry the
    generation, and the runs here restart generations at 0 only for steps the earlier run never reached.
    """
    assert sorted(r["step"] for r in metrics(run_dir) if "loss" in r) == list(range(1, steps + 1))
    assert_each_sample_once(run_dir, record)


# ---------------------------------------------------------------- 4 workers save, M resume
@pytest.fixture(scope="module")
def four_at_30(tmp_path_factory):
    """4 workers to step 30, a checkpoint every 10 steps, sample ids recorded."""
    root = tmp_path_factory.mktemp("four")
    run, record = root / "run", root / "record"
    record.mkdir()
    train_ok(run, "launcher.workers=4", "trainer.max_steps=30", *SAVE_EVERY, env={"EF_PROBE_RECORD": str(record)})
    return run, record


def copy_of(four_at_30, dest: Path):
    run, record = four_at_30
    shutil.copytree(run, dest / "run")
    shutil.copytree(record, dest / "record")
    return dest / "run", dest / "record"


@pytest.mark.parametrize("workers", [3, 1, 2])
def test_save_with_4_resume_with_m_equals_the_uninterrupted_run(tmp_path, four_at_30, reference, workers):
    step30 = saved(four_at_30[0])["step_30"]
    meta = ckpt.read_metadata(step30)
    assert meta["world_size"] == 4 and sorted(meta["files"]) == [ckpt.shard_name(r, 4) for r in range(4)]
    run, record = copy_of(four_at_30, tmp_path)
    out = train_ok(run, f"launcher.workers={workers}", *SAVE_EVERY, env={"EF_PROBE_RECORD": str(record)})
    assert f"resumed from {run / step30.relative_to(four_at_30[0])}" in out
    assert_equivalent(run, reference)
    assert_exactly_once(run, record)
    final = saved(run)["step_60"]
    assert sorted(saved(run)) == ["step_10", "step_20", "step_30", "step_40", "step_50", "step_60"]
    assert final.parent.name == step30.parent.name  # the same job directory across the restart
    assert len(ckpt.read_metadata(final)["files"]) == workers
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[30] == 4 and world[31] == workers


# ---------------------------------------------------------------- kills during a save
PHASES = ["before_write", "mid_write", "after_write", "before_commit", "before_rename"]


@pytest.mark.parametrize("phase", PHASES)
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, reference, phase):
    run = tmp_path / "run"
    proc = start(run, *SAVE_EVERY, env={"ELASTICFLOW_TEST_CKPT_KILL": f"{phase}:20"})
    out = finish(proc)
    assert proc.returncode == -9, out[-3000:]  # SIGKILLed by the hook, in the save of step 20
    assert sorted(saved(run)) == ["step_10"]
    assert ckpt.read_metadata(ckpt.latest(run / "checkpoints"))["step"] == 10
    ckpt.load(ckpt.latest(run / "checkpoints"))  # loadable, checksums intact
    out = train_ok(run, *SAVE_EVERY)
    assert "resumed from" in out and "step_10" in out.split("resumed from")[1].splitlines()[0]
    assert_equivalent(run, reference, redone=True)  # the steps redone after the resume are logged again
    assert leftovers(run) == []  # the dead save's temporary directory went with the next commit


@pytest.mark.parametrize("rank,phase", [(1, "mid_write"), (0, "before_commit")])
def test_member_killed_during_a_save_training_goes_on(tmp_path, reference, rank, phase):
    run = tmp_path / "run"
    out = train_ok(run, "launcher.workers=3", *SAVE_EVERY, "elastic.heartbeat_timeout_s=2",
                   env={"ELASTICFLOW_TEST_CKPT_KILL": f"{phase}:20:{rank}"})
    if rank != 0:  # rank 0 gave the save up once the agent declared the member gone, not elastic.timeout_s later
        assert "step_20 not committed: rank(s) 1 left the job before reporting" in out, out[-3000:]
    # The first interval save after the recovery is committed: step_30, unless the async write of step_20
    # was still running when step 30's save began (a loaded machine), so that the kill at its commit took
    # step 30's save down with it.
    recovered_at = next(e["step"] for e in events(run) if e["event"] == "recovered")
    next_save = (recovered_at // 10 + 1) * 10
    assert "step_20" not in saved(run) and {"step_10", f"step_{next_save}", "step_60"} <= set(saved(run))
    assert len([e for e in events(run) if e["event"] == "left"]) == 1
    assert_equivalent(run, reference)
    assert leftovers(run) == []


def test_a_final_save_that_did_not_commit_fails_the_run_and_a_rerun_resumes(tmp_path, reference):
    """A member killed while writing the final checkpoint: rank 0 gives the save up, and the run fails in one
    line naming the newest checkpoint (it used to end `done`, exit 0, with step_40, and steps 41-60 lost).
    The same command again resumes from step_40 and ends on the 1-worker model."""
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=2", "checkpoint.interval.steps=20", "elastic.heartbeat_timeout_s=2",
                 env={"ELASTICFLOW_TEST_CKPT_KILL": f"mid_write:{STEPS}:1"})
    out = finish(proc)
    assert proc.returncode not in (0, -9), out[-3000:]
    assert "rank(s) 1 left the job before reporting" in out, out[-3000:]  # not elastic.timeout_s later
    assert (f"error: the final checkpoint (step {STEPS}) did not commit, so the trained state is not on disk (the "
            "newest checkpoint is step_40") in out, out[-3000:]
    assert sorted(saved(run)) == ["step_20", "step_40"]
    out = train_ok(run, "launcher.workers=2", "checkpoint.interval.steps=20")
    assert "resumed from" in out and "step_40" in out.split("resumed from")[1].splitlines()[0]
    assert_equivalent(run, reference, redone=True)


# ---------------------------------------------------------------- broken checkpoints
def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_corrupt_shard_names_the_file_and_auto_falls_back(tmp_path, four_at_30):
    run, _ = copy_of(four_at_30, tmp_path)
    shard = saved(run)["step_30"] / ckpt.shard_name(2, 4)
    flip_a_byte(shard)
    with pytest.raises(ElasticFlowError, match=f"checkpoint shard '{shard}' fails its checksum"):
        ckpt.load(shard.parent)
    ckpt.load(shard.parent, names=["out/b"])  # a partial read that does not touch the bad bytes
    proc = cli(["train", PROBE, f"hydra.run.dir={tmp_path / 'x'}", f"resume={shard.parent}", "trainer.max_steps=40",
                "trainer.progress=false"])
    assert proc.returncode != 0 and str(shard) in one_error_line(proc.stderr)
    out = train_ok(run, "trainer.max_steps=40", *SAVE_EVERY)
    assert f"skipping checkpoint {shard.parent}" in out and "falling back" in out
    assert "resumed from" in out and "step_20" in out.split("resumed from")[1].splitlines()[0]


def test_truncated_shard_and_missing_shard(tmp_path, four_at_30):
    run, _ = copy_of(four_at_30, tmp_path)
    step20, step30 = saved(run)["step_20"], saved(run)["step_30"]
    shard = step30 / ckpt.shard_name(1, 4)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ElasticFlowError, match=f"'{shard}' fails its checksum \\(corrupt or truncated"):
        ckpt.load(step30)
    (step20 / ckpt.shard_name(3, 4)).unlink()
    with pytest.raises(ElasticFlowError, match=f"checkpoint shard '{step20 / ckpt.shard_name(3, 4)}' is missing"):
        ckpt.load(step20)
    proc = cli(["train", PROBE, f"hydra.run.dir={tmp_path / 'x'}", f"resume={step20}", "trainer.max_steps=40",
                "trainer.progress=false"])
    assert "is missing" in one_error_line(proc.stderr)
    out = train_ok(run, "trainer.max_steps=40", *SAVE_EVERY)  # both skipped: step_10 it is
    assert "step_10" in out.split("resumed from")[1].splitlines()[0]


def test_truncated_metadata_is_a_clear_error(tmp_path, four_at_30):
    run, _ = copy_of(four_at_30, tmp_path)
    step30 = saved(run)["step_30"]
    meta = step30 / "metadata.json"
    meta.write_text(meta.read_text()[:200])
    proc = cli(["inspect", step30])
    assert proc.returncode != 0 and "is corrupt or truncated" in one_error_line(proc.stderr)
    with pytest.raises(ElasticFlowError, match="metadata.json' is corrupt or truncated"):
        ckpt.load(step30)
    assert ckpt.latest(run / "checkpoints").name == "step_20"  # unreadable metadata sorts first


def test_incompatible_model_lists_the_differences(tmp_path, four_at_30):
    run, _ = copy_of(four_at_30, tmp_path)
    proc = cli(["train", PROBE, f"hydra.run.dir={run}", "+model_args.hidden=32", "trainer.max_steps=40",
                "trainer.progress=false"])
    line = one_error_line(proc.stderr)
    assert "does not match this model" in line
    assert "hidden/W: model has shape (64, 32), checkpoint has (64, 64)" in line
    assert "out/W: model has shape (32, 10), checkpoint has (64, 10)" in line


def test_inspect_shows_which_shard_holds_which_range(four_at_30):
    proc = run_cli(["inspect", four_at_30[0] / "checkpoints"], timeout=60)  # checkpoint.dir: its newest
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "step 30" in out and "world size 4" in out and "4 shard file(s) written by 4 rank(s)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["hidden/W"][1:3] == ["float32", "64x64"]
    meta = ckpt.read_metadata(saved(four_at_30[0])["step_30"])
    for r in range(4):
        name = ckpt.shard_name(r, 4)
        assert rows[name][1] == str(r) and rows[name][4] == meta["files"][name]["checksum"]
    pieces = meta["tensors"]["hidden/W"]["shards"]
    assert " ".join(rows["hidden/W"][5:]) == " ".join(
        f"r{meta['files'][p['file']]['rank']}[{p['start']}:{p['end']}]" for p in pieces)


# ---------------------------------------------------------------- torch -> TensorFlow
def test_torch_checkpoint_of_4_reshards_onto_tensorflow(tmp_path, four_at_30, reference):
    if not (REPO / "elasticflow" / "backends" / "tensorflow").is_dir():
        pytest.skip("the TensorFlow backend is not there yet")
    pytest.importorskip("tensorflow")
    run, _ = copy_of(four_at_30, tmp_path)
    train_ok(run, "backend=tensorflow", "launcher.workers=2", *SAVE_EVERY)
    meta = ckpt.read_metadata(saved(run)["step_60"])
    assert meta["backend"] == "tensorflow" and meta["world_size"] == 2
    assert ckpt.latest(run / "checkpoints") == saved(run)["step_60"]
    # the backends round differently (see test_tensorflow.py): 1e-3 relative; the TensorFlow steps' losses too
    assert_equivalent(run, reference, rtol=1e-3)


# ---------------------------------------------------------------- the checkpoint module itself
STATE = {"W": np.arange(231, dtype=np.float32).reshape(33, 7), "b": np.arange(5, dtype=np.int64),
         "rng/torch": np.arange(77, dtype=np.uint8), "count": np.array(3, np.int64),
         "empty": np.zeros((0, 3), np.float32), "mask": np.array([True, False, True])}
INFO = {"step": 5, "epoch": 0, "cursor": {"epoch": 0, "samples_in_epoch": 50, "samples_seen": 50}}


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 64])
def test_plan_gives_every_element_to_exactly_one_rank(world):
    got = {}
    for rank, pieces in enumerate(plan(specs_of(STATE), world)):
        for p in pieces:
            assert p.rank == rank
            got.setdefault(p.name, []).append((p.start, p.end))
    for name, value in STATE.items():
        at = 0
        for start, end in sorted(got.get(name, [])):
            assert start == at and end > start
            at = end
        assert at == value.size, name
    sizes = [sum(p.nbytes for p in ps) for ps in plan(specs_of(STATE), world)]
    assert max(sizes) - min(sizes) <= 8  # balanced by bytes, to within one element


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_file_checksums_match_the_bytes_and_both_algorithms_load(tmp_path, monkeypatch, algorithm):
    if algorithm == "xxh3_64":
        pytest.importorskip("xxhash")
    monkeypatch.setattr(sys.modules["elasticflow.checkpoint.save"], "CHECKSUM", algorithm)
    job = tmp_path / "job_20250101-000000"
    write_with(3, job)
    meta = ckpt.read_metadata(job / "step_5")
    assert meta["checksum"] == algorithm
    for name, info in meta["files"].items():  # recomputed from the bytes on disk
        assert file_checksum(job / "step_5" / name, algorithm) == info["checksum"]
    assert np.array_equal(ckpt.load(job / "step_5")["W"], STATE["W"])


def write_with(world: int, job: Path, name: str = "step_5", state=STATE, **kw) -> list:
    """W writers as threads, reporting through one in-memory coordinator."""
    coord = ckpt.LocalCoordinator()
    writers = [ckpt.Checkpointer(job, coordinator=coord, token="feed", **kw) for _ in range(world)]
    for rank, w in enumerate(writers):
        w.save(name, state, INFO, rank=rank, world=world)
    return [w.close() for w in writers]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_n_writers_any_reader_and_plain_safetensors(tmp_path, world):
    job = tmp_path / "job_20250101-000000"
    paths = write_with(world, job)
    assert paths[0] == job / "step_5" and paths[1:] == [None] * (world - 1)
    state = ckpt.load(ckpt.latest(tmp_path))
    for name, value in STATE.items():
        assert state[name].dtype == value.dtype and state[name].shape == value.shape
        assert np.array_equal(state[name], value), name
    assert list(ckpt.load(job / "step_5", names=["b"])) == ["b"]
    from safetensors import safe_open

    meta = ckpt.read_metadata(job / "step_5")
    piece = meta["tensors"]["W"]["shards"][-1]
    with safe_open(str(job / "step_5" / piece["file"]), framework="numpy") as f:
        assert np.array_equal(f.get_slice("W")[2:5], STATE["W"].reshape(-1)[piece["start"] + 2:piece["start"] + 5])


def test_async_save_snapshots_before_returning(tmp_path):
    job = tmp_path / "job_20250101-000000"
    live = {"W": np.zeros((1000, 100), np.float32)}
    ck = ckpt.Checkpointer(job)
    ck.save("step_1", live, INFO)
    live["W"] += 1  # training goes on while the writer thread works
    assert ck.close() == job / "step_1"
    assert not ckpt.load(job / "step_1")["W"].any()


def test_the_buffer_reserved_at_start_takes_the_first_snapshot(tmp_path):
    """reserve() (the trainer calls it in prepare()) allocates rank 1's slice buffer in the writer
    thread; the first save of rank 1 of 2 then snapshots into it instead of allocating."""
    from safetensors import safe_open

    job = tmp_path / "job_20250101-000000"
    live = {"W": np.arange(1000 * 100, dtype=np.float32).reshape(1000, 100), "b": np.ones(7, np.float32)}
    ck = ckpt.Checkpointer(job, coordinator=ckpt.LocalCoordinator(), token="t")
    ck.reserve(live, rank=1, world=2)
    assert ck.wait() is None
    reserved = ck._snapshots.buffer
    assert reserved is not None and reserved.nbytes < live["W"].nbytes  # half the state, not all of it
    ck.save("step_1", live, INFO, rank=1, world=2)
    assert ck._snapshots.buffer is reserved
    live["W"] += 1  # training goes on: the snapshot is already taken
    assert ck.close() is None  # rank 1 never commits
    [shard] = job.glob(".step_1.tmp-*/shard-00001-of-00002.safetensors")
    with safe_open(str(shard), framework="numpy") as f:
        tail = f.get_tensor("W")  # rank 1 holds the end of W, as it was at the save
    assert 0 < tail.size < 100000 and np.array_equal(tail, np.arange(100000 - tail.size, 100000, dtype=np.float32))


def test_a_save_the_training_thread_waits_for_is_written_from_the_live_state(tmp_path):
    """wait=True (the final save, Ctrl-C, a save-then-raise) and async_save=false: nothing changes the state
    while it is written, so no snapshot buffer (a copy of the rank's slice, kept for the run) is made."""
    job = tmp_path / "job_20250101-000000"
    live = {"W": np.arange(1000 * 100, dtype=np.float32).reshape(1000, 100), "b": np.ones(7, np.float32)}
    ck = ckpt.Checkpointer(job, coordinator=ckpt.LocalCoordinator(), token="t")
    assert ck.save("step_1", live, INFO, wait=True) == job / "step_1"
    assert ck._snapshots.buffer is None
    sync = ckpt.Checkpointer(tmp_path / "job_20250101-000001", coordinator=ckpt.LocalCoordinator(), token="u",
                             asynchronous=False)
    sync.save("step_1", live, INFO)
    assert sync._snapshots.buffer is None
    ck.save("step_2", live, {**INFO, "step": 2})  # in the background: the snapshot is taken
    assert ck._snapshots.buffer is not None
    live["W"] += 1
    assert ck.close() == job / "step_2"
    assert np.array_equal(ckpt.load(job / "step_1")["W"], live["W"] - 1)
    assert np.array_equal(ckpt.load(job / "step_2")["W"], live["W"] - 1)
    assert np.array_equal(ckpt.load(sync.job_dir / "step_1")["W"], live["W"] - 1)


def test_a_failed_background_write_is_raised_at_the_next_save(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    ck = ckpt.Checkpointer(blocker / "job_20250101-000000")
    assert ck.save("step_1", STATE, INFO) is not None  # returns at once; the thread fails
    with pytest.raises(ElasticFlowError, match="writing checkpoint step_1 .* failed"):
        ck.save("step_2", STATE, {**INFO, "step": 2})
    ck.save("step_3", STATE, {**INFO, "step": 3})
    with pytest.raises(ElasticFlowError, match="writing checkpoint step_3"):
        ck.close()


def test_a_rank_that_never_reports_means_no_commit_and_no_error(tmp_path, caplog):
    job = tmp_path / "job_20250101-000000"
    write_with(1, job, "step_4")
    ck = ckpt.Checkpointer(job, timeout_s=0.3, coordinator=ckpt.LocalCoordinator())
    ck.save("step_5", STATE, INFO, rank=0, world=2)  # rank 1 died before its save
    assert ck.close() is None
    assert "step_5 not committed: rank(s) 1 did not report" in caplog.text
    assert [p.name for p in ckpt.complete_checkpoints(job)] == ["step_4"]
    write_with(1, job, "step_6")  # a later commit clears the abandoned temporary directory
    assert sorted(p.name for p in job.iterdir()) == ["step_4", "step_6"]


def test_keep_and_the_same_state_saved_twice(tmp_path):
    job = tmp_path / "job_20250101-000000"
    ck = ckpt.Checkpointer(job, keep=2)
    for step in (1, 2, 3):
        ck.save(f"step_{step}", STATE, {**INFO, "step": step})
    assert ck.save("step_3", STATE, {**INFO, "step": 3}, wait=True) == job / "step_3"  # not rewritten
    ck.close()
    assert sorted(p.name for p in job.iterdir()) == ["step_2", "step_3"]


def test_concurrent_writers_of_one_save_do_not_collide(tmp_path):
    """Four threads, one save each, one LocalCoordinator: exactly one commit, all shards listed."""
    job = tmp_path / "job_20250101-000000"
    big = {f"t{i}": np.full(10_000, i, np.float32) for i in range(10)}
    coord = ckpt.LocalCoordinator()
    writers = [ckpt.Checkpointer(job, coordinator=coord, token="beef") for _ in range(4)]
    threads = [threading.Thread(target=w.save, args=("step_9", big, {**INFO, "step": 9}, r, 4))
               for r, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [w.close() for w in writers] == [job / "step_9", None, None, None]
    state = ckpt.load(job / "step_9")
    assert all(np.array_equal(state[k], v) for k, v in big.items())


# ---------------------------------------------------------------- the job directory
LINEAR = str(REPO / "models" / "linear.py")


def fit(run_dir: Path, *overrides: str) -> ElasticTrainer:
    cfg = compose(LINEAR, ["trainer.progress=false", "trainer.max_steps=6", "checkpoint.interval.steps=3",
                           *overrides])
    trainer = ElasticTrainer(LINEAR, cfg, run_dir=str(run_dir))
    trainer.fit()
    return trainer


def test_job_directory_is_stable_across_restarts_and_new_for_resume_none(tmp_path):
    first = fit(tmp_path, "trainer.max_steps=3")
    job = first.checkpoints.job_dir
    assert job.parent == tmp_path / "checkpoints" and job.name.startswith("linear_")
    again = fit(tmp_path)
    assert again.checkpoints.job_dir == job and again.resumed_from == str(job / "step_3")
    fresh = fit(tmp_path, "resume=none")
    assert fresh.checkpoints.job_dir != job and fresh.resumed_from is None
    assert ckpt.latest(tmp_path / "checkpoints") == fresh.checkpoints.job_dir / "step_6"
    (tmp_path / ".elasticflow" / "checkpoint_job.json").unlink()  # without the record: the newest job
    assert fit(tmp_path).checkpoints.job_dir == fresh.checkpoints.job_dir
    named = fit(tmp_path, "checkpoint.job_name=exp1", "checkpoint.async_save=false")
    assert named.checkpoints.job_dir.name.startswith("exp1_") and named.resumed_from is None
    assert named.checkpoints.checkpointer.asynchronous is False  # checkpoint.async_save reached the checkpointer
    resumed = fit(tmp_path / "elsewhere", f"resume={job}")  # resume=PATH: a job dir means its newest
    assert resumed.resumed_from == str(job / "step_6")
