"""topology=local_sgd|diloco (elasticflow/train/local_sgd.py) against the same algorithms written plainly here: K model
replicas, each taking sync_every plain SGD steps on its part of every global batch, then an average (local
SGD) or an outer Nesterov step on the averaged move (DiLoCo). One process, several workers, workers killed
mid-round, and checkpoints across topologies all end on the plain loop's parameters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import elasticflow.checkpoint as ckpt
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.train.local_sgd import Outer, owner, part
from elasticflow.data.order import GlobalBatch
from harness import REPO, assert_each_sample_once, assert_equivalent, events, metrics, train_ok
from harness import plain_rounds as plain

MODEL = REPO / "models" / "digits_mlp.py"
BATCH = 64


def by_step(losses) -> dict:
    """Each step's loss as a tensor of its own, for assert_equivalent (the rule on one number: its relative
    difference)."""
    return {f"loss of step {k}": np.float64(loss) for k, loss in enumerate(losses, 1)}


def assert_same_losses(got, want) -> None:
    assert len(got) == len(want), (len(got), len(want))
    assert_equivalent(by_step(got), by_step(want))


def in_process(tmp_path, *overrides):
    from elasticflow.trainer import ElasticTrainer

    cfg = compose(str(MODEL), [f"trainer.global_batch_size={BATCH}", "trainer.progress=false", "trainer.log_every=1",
                               *overrides])
    trainer = ElasticTrainer(str(MODEL), cfg, run_dir=str(tmp_path))
    trainer.fit()
    return trainer.engine.state(), [r["loss"] for r in metrics(tmp_path) if "loss" in r]


# ---------------------------------------------------------------------- the pieces
def test_replicas_are_dealt_to_workers_and_batches_cut_into_contiguous_parts():
    assert [owner(k, 4, 2) for k in range(4)] == [0, 0, 1, 1]  # fewer workers: each trains two
    assert [owner(k, 2, 4) for k in range(2)] == [0, 2]        # more: ranks 1 and 3 wait
    assert [owner(k, 4, 3) for k in range(4)] == [0, 0, 1, 2]
    assert [part(GlobalBatch(0, 1408, 1437), k, 2) for k in range(2)] == [(1408, 1423), (1423, 1437)]


def test_the_outer_step_is_torch_sgd_with_nesterov_and_its_momentum_round_trips_by_name():
    rng = np.random.default_rng(1)
    layout = [("a", (3, 4)), ("b", (5,))]
    start = torch.from_numpy(rng.standard_normal(17).astype(np.float32))
    outer = Outer("diloco", 2, 4, 0.7, 0.9, layout)
    ref = start.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    theta = start
    for _ in range(3):
        delta_sum = torch.from_numpy(rng.standard_normal(17).astype(np.float32))
        theta = outer.step(theta, delta_sum)
        ref.grad = delta_sum / 2
        sgd.step()
        assert torch.equal(theta, ref.detach())  # the same float32 operations, so the same bits
    saved = outer.arrays()
    assert sorted(saved) == ["outer/momentum/a", "outer/momentum/b"] and saved["outer/momentum/a"].shape == (3, 4)
    again = Outer("diloco", 2, 4, 0.7, 0.9, layout)
    again.load(saved)
    assert torch.equal(again.velocity, outer.velocity)
    again.load({})  # a checkpoint of another topology: no momentum yet, as at a fresh start
    assert again.velocity is None
    assert Outer("local_sgd", 2, 4, 1.0, 0.0, layout).step(start, start * 2).abs().max() == 0  # θ − (2θ)/2


# ---------------------------------------------------------------------- one process: the 1-worker result
@pytest.mark.parametrize("kind", ["diloco", "local_sgd"])
def test_one_process_equals_the_plain_loop(tmp_path, kind):
    # 30 steps: rounds of 4, one across the epoch's end (steps 21-24: the epoch's last batch is step 23's,
    # 29 samples split 15 + 14), and one cut short by the run's end (steps 29-30).
    state, losses = in_process(tmp_path, f"topology={kind}", "topology.replicas=2", "topology.sync_every=4",
                               "trainer.max_steps=30")
    expect, expect_losses = plain(kind, 2, 4, 30)
    assert_equivalent(state, expect)
    assert_same_losses(losses, expect_losses)


# ---------------------------------------------------------------------- workers, and workers killed
def test_three_workers_for_four_replicas_equal_the_plain_loop(tmp_path):
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", "topology=diloco", "topology.replicas=4", "topology.sync_every=4")
    expect, expect_losses = plain("diloco", 4, 4, 60)
    assert_equivalent(run, expect)
    assert_same_losses([r["loss"] for r in metrics(run) if "loss" in r], expect_losses)


def test_diloco_survives_workers_killed_mid_round_and_ends_on_the_plain_loop(tmp_path):
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    # Worker 1 dies in its replica's third inner step of the round 13-16; worker 3 in the first of 37-40.
    # Each time the survivors finish their own replicas, fail at the round's sum, regroup, and train only
    # the lost worker's replica again (the Δ of theirs is kept).
    train_ok(run, "launcher.workers=4", "topology=diloco", "topology.replicas=4", "topology.sync_every=4",
             env={"EF_PROBE_KILL": "1:15:forward,3:37:forward", "EF_PROBE_RECORD": str(record)})
    expect, expect_losses = plain("diloco", 4, 4, 60)
    assert_equivalent(run, expect)
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 61))  # every step once
    assert_same_losses([r["loss"] for r in records], expect_losses)
    assert records[-1]["samples_seen"] == 2 * 1437 + 14 * BATCH  # two epochs (23 steps each), 14 steps of a third
    world = [r["world_size"] for r in records]
    assert world[0] == 4 and world[20] == 3 and world[-1] == 2, world
    recovered = events(run, "recovered")
    assert [e["step"] for e in recovered] == [12, 36], recovered  # each costs its round: steps from the sync
    # Each sample once: a replica's part of a step counts from the generation whose training of it was used.
    assert_each_sample_once(run, record)
    # Only the lost worker's replica was trained again, by worker 0 (4 replicas on 3 workers: ranks 0, 0, 1, 2);
    # then worker 3's, by worker 2 (ranks 0, 0, 1, 1). The rest kept what they had trained before the failure.
    trained = {e["first_step"]: e["trained_in"] for e in events(run) if e["event"] == "round"}
    assert trained[13] == [0, 1, 0, 0] and trained[37] == [1, 1, 1, 2], trained



# ---------------------------------------------------------------------- checkpoints across topologies
def test_a_diloco_run_resumed_from_its_checkpoint_equals_one_that_never_stopped(tmp_path):
    common = ("topology=diloco", "topology.replicas=2", "topology.sync_every=4", "checkpoint.interval.steps=8")
    in_process(tmp_path / "a", *common, "trainer.max_steps=12")
    first = ckpt.load(ckpt.latest(tmp_path / "a" / "checkpoints"))
    assert "outer/momentum/hidden/W" in first  # the outer step's momentum is in the checkpoint
    state, _ = in_process(tmp_path / "b", *common, "trainer.max_steps=30",
                          f"resume={ckpt.latest(tmp_path / 'a' / 'checkpoints')}")
    expect, _ = plain("diloco", 2, 4, 30)
    assert_equivalent(state, expect)


def test_ring_and_diloco_checkpoints_resume_under_each_other(tmp_path):
    in_process(tmp_path / "ring", "trainer.max_steps=8")
    ring = ckpt.latest(tmp_path / "ring" / "checkpoints")
    state, _ = in_process(tmp_path / "diloco", "topology=diloco", "topology.replicas=2", "topology.sync_every=4",
                          "trainer.max_steps=16", f"resume={ring}")  # no momentum there: it starts at round 3
    assert all(np.isfinite(v).all() for v in state.values())
    diloco = ckpt.latest(tmp_path / "diloco" / "checkpoints")
    state, losses = in_process(tmp_path / "back", "trainer.max_steps=20", f"resume={diloco}")  # momentum unread
    assert len(losses) == 4 and all(np.isfinite(losses))


# ---------------------------------------------------------------------- what it cannot run with
@pytest.mark.parametrize("overrides, message", [
    (["trainer.shard=optimizer"], "topology=diloco keeps each replica's optimizer state whole"),
    (["trainer.precision=16"], "topology=diloco does not run float16's loss scaling"),
    (["topology.replicas=100", "trainer.global_batch_size=64"], "topology.replicas=100 is more than"),
    (["checkpoint.interval.steps=10"], "checkpoint.interval.steps=10 is not a multiple of topology.sync_every=16"),
    (["trainer.eval_every=20"], "trainer.eval_every=20 is not a multiple of topology.sync_every=16"),
    (["checkpoint.interval.epochs=1", "checkpoint.interval.steps=null"], "checkpoint.interval.epochs is not taken"),
    (["topology.replicas=0"], "topology.replicas"),
])
def test_what_diloco_cannot_run_with_is_refused_at_start_in_one_line(overrides, message):
    with pytest.raises(ElasticFlowError) as err:
        compose(str(MODEL), ["topology=diloco", *overrides])
    assert message in err.value.message and "\n" not in err.value.message, err.value.message
    assert err.value.hint


def test_tensorflow_restarts_its_inner_adam_each_round_as_torch_does(tmp_path):
    # Adam's moments and its bias-correction count start afresh each round (Engine.reset_optimizer): if either
    # backend kept them, the two would part at the second round by far more than rounding.
    common = ("topology=diloco", "topology.replicas=2", "topology.sync_every=4", "trainer.max_steps=12",
              "optimizer=adam")
    tf_state, _ = in_process(tmp_path / "tf", *common, "backend=tensorflow")
    torch_state, _ = in_process(tmp_path / "torch", *common)
    assert_equivalent(tf_state, {n: v for n, v in torch_state.items() if not n.startswith("optimizer/")})
