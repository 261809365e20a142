"""Checkpoints and resume: save at N, continue to M, and get exactly the uninterrupted run.

The headline equivalence and Ctrl-C run the real CLI; the many variations (resume=PATH, keep,
corruption, incomplete directories, native modules) run in-process, where a run costs ~0.1 s.
"""
import logging
import os
import shutil
import signal

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import CheckpointInterval, ElasticTrainer

from harness import (SLOW, assert_equivalent, cli, events, flip_a_byte, logged_step, losses, members, metrics, reap,
                     run_cli, saved, start, stop, train, wait_for)

# Dropout draws from torch's RNG, Adam keeps state, and 200 samples in batches of 16 make 13 steps
# per epoch (the last one of 8): a resume that lost the RNG, the optimizer state or the data cursor
# would show in the losses.
DROPOUT_ADAM = '''
import numpy as np
from elasticflow import ops, optim


def model(cfg):
    rng = np.random.default_rng(cfg.seed)
    return {"W": rng.normal(0, 0.3, (4, 3)).astype(np.float32), "b": np.zeros(3, np.float32),
            "optimizer": optim.Adam(0.02)}


def forward(x, y, params):
    return ops.mse(ops.dropout(x, 0.3) @ params["W"] + params["b"], y)


def data(cfg):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    return x, (x @ rng.normal(size=(4, 3))).astype(np.float32)
'''

# backend.threads=1: these runs train in this process, one after another, and compare bits (rtol=0); the default
# thread count reads the load as each starts (_util/affinity.py), and a busy CI machine gave two of them different
# counts, so different float32 rounding
COMMON = ["trainer.global_batch_size=16", "trainer.log_every=1", "trainer.progress=false", "backend.threads=1"]


def fit(path, run_dir, *overrides):
    cfg = compose(str(path), [*COMMON, *overrides])
    trainer = ElasticTrainer(str(path), cfg, run_dir=str(run_dir))
    trainer.fit()
    return trainer


def step_losses(run_dir):
    """{step: loss} of the training records (a resumed run appends to metrics.jsonl)."""
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


# ---------------------------------------------------------------- the CLI: save at 30, resume to 60
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, write_model):
    path = write_model(DROPOUT_ADAM)
    first, straight = tmp_path / "resumed", tmp_path / "straight"
    train(path, first, "trainer.global_batch_size=16", "trainer.log_every=1", "checkpoint.interval.steps=10",
          "trainer.max_steps=30")
    step30 = ckpt.latest(first / "checkpoints")
    assert step30.name == "step_30"
    proc = train(path, first, "trainer.global_batch_size=16", "trainer.log_every=1", "checkpoint.interval.steps=10",
                 "trainer.max_steps=60")
    assert f"resumed from {step30}" in proc.stderr
    train(path, straight, "trainer.global_batch_size=16", "trainer.log_every=1", "checkpoint.interval.steps=10",
          "trainer.max_steps=60")
    resumed, uninterrupted = step_losses(first), step_losses(straight)
    assert sorted(resumed) == list(range(1, 61))
    assert [resumed[s] for s in range(31, 61)] == [uninterrupted[s] for s in range(31, 61)]
    assert_equivalent(first, straight, rtol=0, rng=True, records=False)  # the same values, random streams too
    # keep=3 (the default): only the newest three remain
    assert sorted(saved(first)) == ["step_40", "step_50", "step_60"]


# ---------------------------------------------------------------- in-process variations
@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """20 steps, a checkpoint every 5, all kept; returns the model path and the run dir."""
    root = tmp_path_factory.mktemp("baseline")
    path = root / "model.py"
    path.write_text(DROPOUT_ADAM)
    fit(path, root / "run", "trainer.max_steps=20", "checkpoint.interval.steps=5", "checkpoint.keep=null")
    return path, root / "run"


def copy_run(run_dir, dest):
    shutil.copytree(run_dir, dest)
    return dest


def test_latest_and_load(baseline, tmp_path):
    _, run = baseline
    assert ckpt.latest(run / "checkpoints") == saved(run)["step_20"]
    assert ckpt.latest(tmp_path) is None and ckpt.latest(tmp_path / "missing") is None
    state = ckpt.load(saved(run)["step_10"])
    assert {k for k in state if not k.startswith("rng/")} == {
        "W", "b", "optimizer/W/exp_avg", "optimizer/W/exp_avg_sq", "optimizer/b/exp_avg", "optimizer/b/exp_avg_sq"}
    assert state["W"].shape == (4, 3) and state["W"].dtype == np.float32
    assert not np.array_equal(state["W"], ckpt.load(saved(run)["step_20"])["W"])
    meta = ckpt.read_metadata(saved(run)["step_10"])
    assert meta["step"] == 10 and meta["cursor"]["samples_seen"] == 160 and meta["optimizer"] == "adam"


def test_resume_from_an_explicit_path(baseline, tmp_path):
    path, run = baseline
    other = tmp_path / "other"
    fit(path, other, "trainer.max_steps=20", f"resume={saved(run)['step_10']}")
    want = step_losses(run)
    assert step_losses(other) == {s: want[s] for s in range(11, 21)}
    assert_equivalent(other, run, rtol=0, rng=True, records=False)  # run's newest: step_20


def test_resume_none_starts_fresh(baseline, tmp_path):
    path, run = baseline
    fresh = fit(path, tmp_path / "fresh", "trainer.max_steps=5", "resume=none")
    assert fresh.resumed_from is None
    again = copy_run(run, tmp_path / "again")
    trainer = fit(path, again, "trainer.max_steps=5", "resume=none")
    assert trainer.resumed_from is None and trainer.step_count == 5
    want = step_losses(run)
    fresh_records = [r for r in metrics(again) if "loss" in r][-5:]
    # the fresh run's steps are logged (after the old run's), and equal the old run's first five
    assert [(r["step"], r["loss"]) for r in fresh_records] == [(s, want[s]) for s in range(1, 6)]
    # ...and its checkpoint is the one a later resume=auto continues from, not the stale step_20
    newest = ckpt.latest(again / "checkpoints")
    assert newest is not None and ckpt.read_metadata(newest)["step"] == 5


def test_keep_retains_the_newest(baseline, tmp_path):
    path, _ = baseline
    fit(path, tmp_path / "run", "trainer.max_steps=20", "checkpoint.interval.steps=5", "checkpoint.keep=2")
    assert sorted(saved(tmp_path / "run")) == ["step_15", "step_20"]
    _, run = baseline
    assert sorted(saved(run)) == ["step_10", "step_15", "step_20", "step_5"]


def test_checkpoint_interval_semantics():
    with pytest.raises(ValueError):
        CheckpointInterval(steps=10, epochs=1)
    every10 = CheckpointInterval(steps=10)
    assert [s for s in range(0, 41) if every10.should_save(current_step=s)] == [10, 20, 30, 40]
    assert not every10.should_save(current_epoch=10) and not every10.should_save()
    every2 = CheckpointInterval(epochs=2)
    assert [e for e in range(0, 7) if every2.should_save(current_epoch=e)] == [2, 4, 6]
    assert not every2.should_save(current_step=20)
    assert not CheckpointInterval().should_save(current_step=10, current_epoch=1)


def test_epoch_interval_names_checkpoints_epoch_n(baseline, tmp_path):
    path, _ = baseline
    trainer = fit(path, tmp_path / "run", "trainer.epochs=3", "checkpoint.interval.epochs=1", "checkpoint.keep=null")
    found = saved(tmp_path / "run")
    assert sorted(found) == ["epoch_1", "epoch_2", "epoch_3"]
    for n in (1, 2, 3):
        meta = ckpt.read_metadata(found[f"epoch_{n}"])
        assert meta["step"] == 13 * n and meta["cursor"] == {"epoch": n, "samples_in_epoch": 0,
                                                             "samples_seen": 200 * n}
    assert trainer.step_count == 39 and ckpt.latest(tmp_path / "run" / "checkpoints").name == "epoch_3"


def test_checkpoint_interval_argument_overrides_the_config(baseline, tmp_path):
    path, _ = baseline
    cfg = compose(str(path), [*COMMON, "trainer.max_steps=8", "checkpoint.interval.steps=5", "checkpoint.keep=null"])
    ElasticTrainer(str(path), cfg, checkpoint_interval=CheckpointInterval(steps=3), run_dir=str(tmp_path)).fit()
    assert sorted(saved(tmp_path)) == ["step_3", "step_6", "step_8"]


def test_corrupt_shard_names_the_file(baseline, tmp_path):
    path, run = baseline
    run = copy_run(run, tmp_path / "run")
    shard = saved(run)["step_20"] / "shard-00000-of-00001.safetensors"
    flip_a_byte(shard)
    with pytest.raises(ElasticFlowError, match=f"checkpoint shard '{shard}' fails its checksum"):
        ckpt.load(shard.parent)
    with pytest.raises(ElasticFlowError, match=str(shard)):
        fit(path, tmp_path / "explicit", "trainer.max_steps=25", f"resume={shard.parent}")
    # resume=auto falls back to the previous good checkpoint, and continues exactly
    trainer = fit(path, run, "trainer.max_steps=20")
    assert trainer.resumed_from == str(saved(run)["step_15"])
    assert_equivalent(run, baseline[1], rtol=0, rng=True, records=False)


def test_directory_without_commit_is_never_loaded(baseline, tmp_path):
    path, run = baseline
    run = copy_run(run, tmp_path / "run")
    step20 = saved(run)["step_20"]
    (step20 / "COMMIT").unlink()
    assert ckpt.latest(run / "checkpoints").name == "step_15"
    with pytest.raises(ElasticFlowError, match="incomplete"):
        ckpt.load(step20)
    trainer = fit(path, run, "trainer.max_steps=20")
    assert trainer.resumed_from == str(saved(run)["step_15"])
    assert ckpt.latest(run / "checkpoints") == saved(run)["step_20"]
    assert_equivalent(run, baseline[1], rtol=0, rng=True, records=False)


def test_a_model_file_edited_since_the_checkpoint_is_named_with_both_hashes(baseline, tmp_path, caplog):
    """A rerun after editing the model file resumed the old checkpoint without a word."""
    import hashlib

    path, run = baseline
    run = copy_run(run, tmp_path / "run")
    edited = tmp_path / path.name
    edited.write_text(path.read_text() + "\n# a comment: the tensors are the same\n")
    then, now = (hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in (path, edited))
    with caplog.at_level(logging.WARNING, logger="elasticflow"):
        fit(edited, run, "trainer.max_steps=25")
    warned = [r.getMessage() for r in caplog.records if "changed since checkpoint" in r.getMessage()]
    assert warned == [f"model file {path.name} changed since checkpoint step_20 was written (sha256 {then} then, "
                      f"{now} now): resuming from it; pass resume=none to start afresh"]
    assert "step_25" in saved(run)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elasticflow"):
        fit(edited, run, "trainer.max_steps=30")  # the file that wrote step_25: nothing to say
    assert not [r for r in caplog.records if "changed since checkpoint" in r.getMessage()]


def test_resume_auto_with_another_optimizer_is_an_error_not_a_fresh_start(baseline, tmp_path):
    path, run = baseline
    run = copy_run(run, tmp_path / "run")
    source = path.read_text().replace('"optimizer": optim.Adam(0.02)', '"optimizer": optim.SGD(0.02)')
    sgd_path = tmp_path / "sgd_model.py"
    sgd_path.write_text(source)
    with pytest.raises(ElasticFlowError, match="holds adam state but this run uses sgd"):
        fit(sgd_path, run, "trainer.max_steps=25")
    assert sorted(saved(run)) == ["step_10", "step_15", "step_20", "step_5"]  # nothing overwritten or pruned


def test_inspect_prints_a_table(baseline):
    _, run = baseline
    proc = run_cli(["inspect", saved(run)["step_10"]], timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "step 10" in out and "samples seen 160" in out and "optimizer adam" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[4:] if line.strip()}
    assert rows["W"][1:3] == ["float32", "4x3"]
    assert rows["optimizer/W/exp_avg_sq"][1:3] == ["float32", "4x3"]
    assert rows["b"][1:3] == ["float32", "3"]
    # A run directory (as export takes it): its newest checkpoint.
    proc = cli(["inspect", run])
    assert proc.returncode == 0 and "step 20" in proc.stdout.splitlines()[1], proc.stderr


# ---------------------------------------------------------------- a native torch.nn.Module
BATCHNORM = '''
import numpy as np
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def model(cfg):
    return Net()


def forward(x, y, params):
    return torch.nn.functional.mse_loss(params(x), y)


def data(cfg):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(96, 4)) * 3 + 2).astype(np.float32)
    return x, np.stack([x[:, 0] - x[:, 1], x[:, 2] * 0.5], axis=1).astype(np.float32)
'''


def test_native_module_buffers_are_saved_and_restored(tmp_path, write_model):
    path = write_model(BATCHNORM)
    run = tmp_path / "run"
    first = fit(path, run, "trainer.max_steps=10", "checkpoint.interval.steps=5")
    state = ckpt.load(saved(run)["step_10"])
    module = first.engine.module
    for name, buffer in module.named_buffers():
        assert state[name].shape == tuple(buffer.shape), name  # num_batches_tracked is a 0-d tensor
        assert np.array_equal(state[name], buffer.numpy()), name
    assert int(state["bn.num_batches_tracked"]) == 10  # one training forward per step, no more
    assert np.abs(state["bn.running_mean"]).max() > 0.1  # the stats moved away from their initial zeros
    assert {"lin.weight", "bn.weight", "out.bias", "optimizer/lin.weight/momentum_buffer"} - set(state) == {
        "optimizer/lin.weight/momentum_buffer"}  # plain SGD keeps no slots

    cfg = compose(str(path), [*COMMON, "trainer.max_steps=20", "checkpoint.interval.steps=5"])
    resumed = ElasticTrainer(str(path), cfg, run_dir=str(run)).prepare()
    assert resumed.resumed_from == str(saved(run)["step_10"])
    buffers = dict(resumed.engine.module.named_buffers())
    assert np.array_equal(buffers["bn.running_var"].numpy(), state["bn.running_var"])
    assert int(buffers["bn.num_batches_tracked"]) == 10
    resumed.fit()

    straight = fit(path, tmp_path / "straight", "trainer.max_steps=20")
    assert_equivalent(run, tmp_path / "straight", rtol=0, rng=True, records=False)
    assert straight.step_count == resumed.step_count == 20


# ---------------------------------------------------------------- Ctrl-C
def test_ctrl_c_writes_a_checkpoint_exits_130_and_resumes(tmp_path):
    path = SLOW
    run = tmp_path / "run"
    proc = start(run, "trainer.progress=false", "trainer.log_every=1", "trainer.global_batch_size=8",
                 "trainer.max_steps=100000", model=path, common=[])
    try:
        wait_for(lambda: logged_step(run) >= 3, 120, "step 3", proc=proc)
        out = stop(proc, signal.SIGINT)
    finally:
        reap(proc)
    assert proc.returncode == 130, out
    assert "interrupted" in out and "Traceback" not in out
    last = max(step_losses(run))
    newest = ckpt.latest(run / "checkpoints")
    assert newest.name == f"step_{last}" and ckpt.read_metadata(newest)["step"] == last

    again = train(path, run, "trainer.log_every=1", "trainer.global_batch_size=8", f"trainer.max_steps={last + 2}")
    assert f"resumed from {newest}" in again.stderr
    assert sorted(step_losses(run)) == list(range(1, last + 3))
    assert len(losses(run)) == last + 2  # no step logged twice


# A 200 MB parameter, so that writing the step-4 checkpoint takes far longer than reaching step 5's forward,
# which raises (a user's bug): the error exit must let the save in flight commit, not kill its writer.
BIG_THEN_FAIL = '''
import numpy as np
import elasticflow
from elasticflow import ops


def model(cfg):
    return {"big": np.zeros(50_000_000, np.float32), "W": np.zeros((4, 3), np.float32)}


def forward(x, y, params):
    if elasticflow.context().step == 5 and elasticflow.context().rank in RANKS:
        raise RuntimeError("a bug in forward at step 5")
    return ops.mse(x @ params["W"], y) + 0.0 * ops.sum(params["big"][:1])


def data(cfg):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return x, (x @ rng.normal(size=(4, 3))).astype(np.float32)
'''


@pytest.mark.parametrize("ranks", ["(0, 1)", "(1,)"])
def test_an_error_exit_lets_the_checkpoint_in_flight_commit(tmp_path, write_model, ranks):
    # (0, 1): both fail, each lets its own save finish first. (1,): only rank 1 fails; the agent then SIGTERMs
    # rank 0 (the one that commits), which lets the save commit before it dies.
    run = tmp_path / "run"
    done = train(write_model(BIG_THEN_FAIL.replace("RANKS", ranks)), run, "launcher.workers=2", "trainer.global_batch_size=16", "trainer.max_steps=8",
                 "checkpoint.interval.steps=4",
                 "checkpoint.async_save=true", check=False, timeout=300)
    assert done.returncode != 0 and "a bug in forward at step 5" in done.stderr, done.stderr[-2000:]
    latest = ckpt.latest(run / "checkpoints")
    assert latest is not None and latest.name == "step_4", latest  # written in the background as step 5 failed
    assert ckpt.load(latest)["big"].shape == (50_000_000,)


def test_sigterm_lets_the_checkpoint_in_flight_commit_before_the_workers_die(tmp_path, write_model):
    """SLURM's scancel and Kubernetes' pod deletion send SIGTERM: a worker lets the save it is writing commit,
    then dies by SIGTERM as before."""
    run, pids = tmp_path / "run", []
    big = BIG_THEN_FAIL.replace("RANKS", "()").replace("50_000_000", "100_000_000")  # 200 MB a rank to write
    proc = start(run, "trainer.progress=false", "launcher.workers=2", "trainer.global_batch_size=16",
                 "trainer.max_steps=400", "checkpoint.interval.steps=4", model=write_model(big), common=[])
    try:
        def both_writing():  # each rank copied its half of the step-4 state and is writing it in the background
            return len(list(run.glob("checkpoints/*/.step_4.tmp*/shard-*.safetensors"))) == 2

        wait_for(both_writing, 120, "both ranks writing the step-4 checkpoint")
        pids = [m["pid"] for m in members(run)]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        for pid in [proc.pid, *pids]:  # nothing left behind if an assertion above failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    exits = events(run, "left")
    assert exits and all("SIGTERM" in e["cause"] for e in exits), exits  # each still dies by SIGTERM
    latest = ckpt.latest(run / "checkpoints")
    assert latest is not None and latest.name == "step_4", latest
