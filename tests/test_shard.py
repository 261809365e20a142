"""Sharded optimizer state (trainer.shard, ZeRO stages 1 and 2) that stays elastic, on real processes.

Each run must end on the parameters AND the optimizer state of a 1-worker run with replicated state
(trainer.shard=none) (harness.assert_equivalent: per tensor, relative difference <= 1e-5). A SIGKILL restores the dead worker's slice from its buddy in memory; a join and a 4->2
shrink move only the ranges that change owner; two neighbours killed at once lose a slice with both its
copies, and the job falls back to the newest checkpoint, says so, and still ends on the same model.
"""
import numpy as np
import pytest

from harness import (assert_equivalent, events, final_state, finish, logged_step, metrics, scale, start, train_ok,
                     wait_for)

from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.replica.shard import needed, owned, plan_moves, MAX_HELD

OPTIMIZERS = {"sgd": ["optimizer.momentum=0.9", "optimizer.lr=0.05"], "adam": ["optimizer=adam", "optimizer.lr=0.003"]}
SAVE = ["checkpoint.interval.steps=10"]


def assert_same_state(run_dir, reference, **kw):
    """The 1-worker run's parameters and optimizer state (harness.assert_equivalent; the random streams too)."""
    assert any(n.startswith("optimizer/") for n in final_state(reference))
    assert_equivalent(run_dir, reference, rng=True, **kw)


@pytest.fixture(scope="module")
def references(one_worker):
    """The 1-worker runs with replicated state, SGD with momentum and Adam. checkpoint.keep=null (which checkpoints
    stay on disk, not what is trained) makes SGD's the very run tests/test_shard_checkpoint.py compares with: the
    suite trains it once (harness.one_worker_run's cache is keyed by the command line)."""
    return {name: one_worker(*overrides, *SAVE, "checkpoint.keep=null", here=True)
            for name, overrides in OPTIMIZERS.items()}


@pytest.fixture(scope="module")
def tf_adam_reference(one_worker):
    pytest.importorskip("tensorflow")
    return one_worker("backend=tensorflow", *OPTIMIZERS["adam"], *SAVE)


# ---------------------------------------------------------------- the layout and the transfer plan
def test_slices_cover_the_vector_once_and_buddies_hold_the_previous_rank():
    for n, world in ((10, 3), (4810, 4), (7, 7), (5, 8)):
        ranges = [owned(n, world, r) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        for r in range(world):
            held = needed(n, world, r, 1)
            assert ranges[r] in held or ranges[r][0] == ranges[r][1]  # more members than elements: empty slices
    assert needed(10, 3, 0, 1) == [(0, 4), (8, 10)] and needed(10, 3, 0, 0) == [(0, 4)]


def _row(progress, *ranges):
    row = [progress, len(ranges)] + [x for r in ranges for x in r]
    return row + [0] * (2 + 2 * MAX_HELD - len(row))


def test_plan_moves_only_ranges_that_change_owner_and_uses_the_buddy_of_a_dead_owner():
    n = 12  # 3 members held [0,4)+[8,12), [4,8)+[0,4), [8,12)+[4,8); member 1 died: 2 survivors remain
    table = np.array([_row(64, (0, 4), (8, 12)), _row(64, (4, 8), (8, 12))])  # survivors: old ranks 0 and 2
    plan = plan_moves(table, {r: needed(n, 2, r, 1) for r in range(2)})
    assert not plan.lost and plan.target == 64
    moved = [(p.src, p.dst, p.lo, p.hi) for p in plan.moves if p.src != p.dst]
    # W=2 with buddies: each holds both slices. Member 1 (old rank 2) held the dead one's [4,8) as its
    # buddy and gives it to member 0; member 0 gives [0,4); nothing else moves.
    assert moved == [(1, 0, 4, 6), (1, 0, 6, 8), (0, 1, 0, 4)]
    # A member behind (progress 0) is never a source; a range held only behind is lost.
    table = np.array([_row(64, (0, 6)), _row(0, (6, 12))])
    assert plan_moves(table, {0: [(0, 6)], 1: [(6, 12)]}).lost == [(6, 12)]


def test_a_bad_shard_setting_is_one_error_with_a_hint():
    with pytest.raises(ElasticFlowError) as e:
        compose("models/digits_mlp.py", ["trainer.shard=zero3"])
    assert "trainer.shard must be one of none, optimizer, gradients, parameters, got 'zero3'" in e.value.message
    assert "trainer.shard=optimizer" in e.value.hint
    with pytest.raises(ElasticFlowError, match="elastic.shard_replicas must be 0 or 1"):
        compose("models/digits_mlp.py", ["elastic.shard_replicas=2"])


# ---------------------------------------------------------------- real processes
@pytest.mark.parametrize("stage,opt", [("optimizer", "sgd"), ("gradients", "adam")])
def test_three_workers_one_killed_match_one_worker(tmp_path, references, stage, opt):
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=3", f"trainer.shard={stage}", *OPTIMIZERS[opt], *SAVE,
             env={"EF_PROBE_KILL": "1:23:reduction"})
    assert_same_state(run, references[opt])
    sizes = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert sizes[0] == 3 and sizes[-1] == 2
    kinds = [e["event"] for e in events(run)]
    assert "fell_back" not in kinds  # the dead worker's slice came from its buddy, in memory
    recovered = [e for e in events(run) if e["event"] == "recovered"]
    assert recovered and recovered[0]["shard_elements_moved"] > 0


def test_tensorflow_two_workers_one_killed_match_one_worker(tmp_path, tf_adam_reference):
    """The sharded update runs torch's formulas on TensorFlow's flat gradient (its variables are written
    back after the allgather); the survivor takes the dead worker's slice of Adam's state from its buddy copy.
    Two workers, not three: each TF worker spends seconds importing TensorFlow, and the slices and buddies of
    three are the torch tests' above (the same code on either backend)."""
    run, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()  # under tf.function the probe injects its faults at the data fetch, which records
    train_ok(run, "backend=tensorflow", "launcher.workers=2", "trainer.shard=optimizer", *OPTIMIZERS["adam"], *SAVE,
             env={"EF_PROBE_KILL": "1:23:reduction", "EF_PROBE_RECORD": str(record)})
    assert_same_state(run, tf_adam_reference)
    sizes = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert sizes[0] == 2 and sizes[-1] == 1
    kinds = [e["event"] for e in events(run)]
    # Adam's moments equal the reference's and no checkpoint was read: the dead worker's slice came from the copy
    # its buddy, the survivor, held (which now owns every range: nothing moves between members)
    assert "fell_back" not in kinds and kinds.count("recovered") == 1, kinds


def test_two_neighbours_killed_fall_back_to_the_checkpoint(tmp_path, references):
    run = tmp_path / "run"
    # checkpoint.async_save=false: step 20's save is committed before step 21 (in the background, a loaded machine
    # had a victim still writing its shard at step 25: step 20 never committed, and the job rightly fell back
    # to step 10)
    proc = start(run, "launcher.workers=4", "trainer.shard=optimizer", *OPTIMIZERS["sgd"], *SAVE,
                 "checkpoint.async_save=false", env={"EF_PROBE_KILL": "1:25:forward,2:25:forward"})
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "fell back to checkpoint" in out and "redoing 4 step(s)" in out
    fell = [e for e in events(run) if e["event"] == "fell_back"]
    assert len(fell) == 1 and fell[0]["step"] == 20 and fell[0]["steps_redone"] == 4
    assert_same_state(run, references["sgd"], redone=True)  # steps 21-24 trained, lost, trained again


def test_join_and_shrink_four_to_two_move_slices_in_memory(tmp_path, references):
    run, pace = tmp_path / "run", tmp_path / "pace"
    pace.touch()  # slow steps while the workers join and retire; lifted once back at 2
    proc = start(run, "launcher.workers=2", "launcher.max_workers=4", "trainer.shard=optimizer",
                 *OPTIMIZERS["adam"], *SAVE, env={"EF_PROBE_SLEEP": "0.35", "EF_PROBE_PACE": str(pace)})
    wait_for(lambda: logged_step(run) >= 5, 120, "step 5")
    scale(run, 4)
    wait_for(lambda: any(r.get("world_size") == 4 for r in metrics(run) if "loss" in r), 60, "a 4-worker step")
    scale(run, 2)
    wait_for(lambda: (metrics(run)[-1].get("world_size") == 2 and "retired" in [e["event"] for e in events(run)]),
             60, "a 2-worker step after the retirements")
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    sizes = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert sizes[0] == 2 and 4 in sizes and sizes[-1] == 2
    kinds = [e["event"] for e in events(run)]
    assert "fell_back" not in kinds and kinds.count("retired") == 2, kinds
    logs = "".join(p.read_text() for p in (run / "logs").glob("worker-*.log"))
    assert "handed over" in logs  # the retiring workers' ranges moved before they left
    assert_same_state(run, references["adam"])


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("spec", ["sgd_nesterov_wd", "adam_l2", "adamw"])
def test_the_update_over_slices_is_the_update_over_the_whole_vector(spec, grouped):
    """The sliced update is torch.optim's (SGD) or the flat Adam's formula per element: two slices updated
    alone end where one update of the whole vector does (to float32 rounding of vectorised kernels), also
    where a parameter group's stretch (another lr, no weight decay) begins inside a slice."""
    import torch

    from elasticflow.backends.torch.optim import FlatAdam
    from elasticflow.optim import SGD, Adam, AdamW, Hyper
    from elasticflow.replica.shard import FlatUpdate

    spec = {"sgd_nesterov_wd": SGD(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
            "adam_l2": Adam(0.01, weight_decay=0.1), "adamw": AdamW(0.01)}[spec]
    runs = [(0, 500, Hyper(1.0, spec.weight_decay)), (500, 1000, Hyper(2.0, 0.0))] if grouped else \
        [(0, 1000, Hyper(1.0, spec.weight_decay))]
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=g)
    grads = [torch.randn(1000, generator=g) for _ in range(5)]
    whole, sliced = start.clone(), start.clone()
    if isinstance(spec, SGD):
        params = [torch.nn.Parameter(whole[lo:hi]) for lo, hi, _ in runs]  # views of whole
        opt = torch.optim.SGD([{"params": [q], "lr": spec.lr * h.lr_scale, "weight_decay": h.weight_decay}
                               for q, (_, _, h) in zip(params, runs)], lr=spec.lr, momentum=spec.momentum,
                              nesterov=True)
    else:
        grad = torch.zeros(1000)
        params = [torch.nn.Parameter(whole)]
        opt = FlatAdam(spec, whole, grad, params, runs)
    update = FlatUpdate(spec, runs, [hi - lo for lo, hi, _ in runs])
    ranges = [(0, 333), (333, 1000)]
    slots = {r: {s: torch.zeros(r[1] - r[0]) for s in update.slots} for r in ranges}
    scratch = torch.empty(2000)
    for step, gr in enumerate(grads, 1):
        if isinstance(spec, SGD):
            for q, (lo, hi, _) in zip(params, runs):
                q.grad = gr[lo:hi].clone()
        else:
            grad.copy_(gr)
        opt.step()
        for lo, hi in ranges:
            update(lo, sliced[lo:hi], gr[lo:hi], slots[(lo, hi)], spec.lr, update.plan(step), scratch)
    np.testing.assert_allclose(sliced.numpy(), whole.numpy(), rtol=1e-6, atol=1e-7)
