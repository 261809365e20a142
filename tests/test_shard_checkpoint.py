"""Checkpoints of sharded optimizer state: each worker writes its own slice (nothing gathered), and the
checkpoint loads onto any number of workers, any trainer.shard setting and the other backend.

Each chain (steps written one way, the rest of 60 resumed another way: at step 30, and from TensorFlow back to
torch at step 40) must end on the 60-step run of one worker with replicated state (harness.assert_equivalent):
relative difference per tensor <= 1e-5 on one backend; across backends <= 1e-4 (TensorFlow's float32 kernels
round differently from torch's: the same bound as comparing the two backends' plain runs).
"""
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from harness import (Limit, assert_equivalent, final_state, members, run_cli, saved, start, train_ok, wait_for)

SGD = ["optimizer.momentum=0.9", "optimizer.lr=0.05", "checkpoint.interval.steps=10", "checkpoint.keep=null"]


def state_at(run_dir, step):
    found = [p for p in ckpt.complete_checkpoints(run_dir / "checkpoints") if p.name == f"step_{step}"]
    assert found, f"no step_{step} under {run_dir}"
    return found[-1]


def assert_same_state(got_dir, want_dir, rtol=1e-5):
    """Both runs end at step 60 on the same parameters, optimizer state included (harness.assert_equivalent; a
    chain resumed elsewhere logged only its own steps)."""
    assert ckpt.read_metadata(ckpt.latest(got_dir / "checkpoints"))["step"] == 60
    assert ckpt.read_metadata(ckpt.latest(want_dir / "checkpoints"))["step"] == 60
    assert any(n.startswith("optimizer/") for n in final_state(want_dir))
    assert_equivalent(got_dir, want_dir, rtol=rtol, rng=True, records=False)


@pytest.fixture(scope="module")
def reference(one_worker):
    return one_worker(*SGD, here=True)


@pytest.fixture(scope="module")
def sharded_torch(tmp_path_factory):
    """30 steps on 3 workers with trainer.shard=optimizer: each shard file holds its writer's own slice."""
    run = tmp_path_factory.mktemp("sharded")
    train_ok(run, "launcher.workers=3", "trainer.shard=optimizer", "trainer.max_steps=30", *SGD)
    return run


def test_a_sharded_checkpoint_holds_each_workers_own_slice(sharded_torch):
    meta = ckpt.read_metadata(state_at(sharded_torch, 30))
    assert meta["writers"] == 3
    params = ["hidden/W", "hidden/b", "out/W", "out/b"]  # the model's flat order
    sizes = [int(np.prod(meta["tensors"][p]["shape"])) for p in params]
    offsets = dict(zip(params, np.cumsum([0] + sizes)))
    chunk = -(-sum(sizes) // 3)
    for p in params:
        for piece in meta["tensors"][f"optimizer/{p}/momentum_buffer"]["shards"]:
            rank = meta["files"][piece["file"]]["rank"]
            # each element of a momentum buffer was written by the owner of its place in the flat vector
            first, last = offsets[p] + piece["start"], offsets[p] + piece["end"] - 1
            assert first // chunk == rank and last // chunk == rank, (p, piece, rank)


def test_sharded_checkpoint_resumes_on_one_worker_without_sharding(tmp_path, reference, sharded_torch):
    run = tmp_path / "run"
    train_ok(run, f"resume={state_at(sharded_torch, 30)}", *SGD)
    assert_same_state(run, reference)


def test_replicated_checkpoint_resumes_sharded_on_two_workers(tmp_path, reference):
    run = tmp_path / "run"
    train_ok(run, f"resume={state_at(reference, 30)}", "launcher.workers=2", "trainer.shard=gradients", *SGD)
    assert_same_state(run, reference)


def test_sharded_checkpoints_cross_backends(tmp_path, reference, sharded_torch):
    pytest.importorskip("tensorflow")
    on_tf = tmp_path / "tf"  # torch's sharded checkpoint, resumed on TensorFlow, sharded again on 2 workers
    train_ok(on_tf, "backend=tensorflow", f"resume={state_at(sharded_torch, 30)}", "launcher.workers=2",
             "trainer.shard=optimizer", *SGD)
    assert_same_state(on_tf, reference, rtol=1e-4)
    # TensorFlow's sharded checkpoint, resumed on torch without sharding: the one that TF run wrote at step 40 (a
    # TF job of its own would only add seconds of TensorFlow imports), each of its 2 workers writing its slice.
    tf_sharded = state_at(on_tf, 40)
    meta = ckpt.read_metadata(tf_sharded)
    assert meta["backend"] == "tensorflow" and meta["writers"] == 2, meta
    back = tmp_path / "back"
    train_ok(back, f"resume={tf_sharded}", *SGD)
    assert_same_state(back, reference, rtol=1e-4)


def test_a_save_the_store_could_not_commit_is_committed_from_its_files_and_resumed(tmp_path, reference):
    """The agent's store cannot be reached at the last save (the agent SIGKILLed, its store with it): no worker
    holds all the sharded optimizer state, so each writes its own shard and its report beside it, and rank 0 commits
    the save from those files before it exits (it used to leave them for `elasticflow checkpoint commit`, which
    tests/test_checkpoint_finish.py tests, with the next start's commit and the refusals). A resume=auto run loads
    it and ends on the 1-worker model."""
    run = tmp_path / "run"
    limit = Limit(tmp_path / "limit", 20)
    proc = start(run, "launcher.workers=3", "trainer.shard=optimizer", *SGD, env={"EF_PROBE_LIMIT": str(limit.path)})
    try:
        wait_for(lambda: "step_20" in saved(run), 120, "step_20 committed", proc=proc)
        pids = [m["pid"] for m in members(run)]
        os.kill(proc.pid, signal.SIGKILL)  # the agent, and the job's store with it
        proc.wait(30)
    finally:
        limit.lift()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 120, "every worker to exit")
    job = next((run / "checkpoints").iterdir())
    assert not [p.name for p in job.iterdir() if p.name.startswith(".step_")], sorted(job.iterdir())
    last = ckpt.latest(job)
    assert last.name not in ("step_10", "step_20") and ckpt.read_metadata(last)["writers"] == 3, sorted(saved(run))
    log0 = (run / "logs" / "worker-0.log").read_text()
    assert f"checkpoint {last} committed from its 3 shard files: the agent's store could not be reached" in log0, \
        log0[-3000:]
    done = run_cli(["checkpoint", "commit", run], check=True)
    assert done.stdout.startswith(f"nothing to commit in {job}"), done.stdout
    out = train_ok(run, *SGD)  # one worker, replicated: the 3 sharded slices load whole
    assert f"resumed from {last}" in out, out[-3000:]
    assert_same_state(run, reference)
