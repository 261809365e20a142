"""topology=parameter_server (elasticflow/replica/parameter_server.py): aggregators hold the shards, trainers push and pull.
The roles' deal on its own; then real runs against the 1-worker reference, with aggregators and trainers
killed, and the fallback when a shard has no copy left."""
from __future__ import annotations

import os
import signal

import pytest

import elasticflow.checkpoint as ckpt
from elasticflow.config.schema import compose, validate
from elasticflow.errors import ElasticFlowError
from elasticflow.replica.parameter_server import Layout, deal, handoff
from harness import (REPO, Limit, assert_equivalent, assert_replicas_hold_the_checkpoint, events, exact_reference,
                     finish, logged_step, members, metrics, saved, scale, start, train_exact, train_ok, wait_for)

PS = ["topology=parameter_server", "checkpoint.interval.steps=10"]
T = (-1, -1)  # a trainer's (or a new member's) previous role


# ---------------------------------------------------------------------- the deal
def test_roles_are_dealt_spread_over_hosts_and_never_to_rank_0_first():
    layout = deal([T] * 6, [1, 1, 1, 2, 2, 2], shards=1, copies=2)
    primary, standby = layout.holders
    assert {primary, standby} == {2, 5}  # one per host, each its host's highest rank
    assert layout.trainers == [0, 1, 3, 4]
    assert deal([T] * 3, [7, 7, 7], 2, 1).holders == (2, 1)


def test_roles_stick_and_a_standby_takes_over_its_dead_primary():
    first = deal([T] * 5, [1, 1, 1, 2, 2], shards=1, copies=2)
    assert first.holders == (4, 2)  # the primary on host 2, its standby on host 1
    assert deal([first.role(r) for r in range(5)], [1, 1, 1, 2, 2], 1, 2) == first  # nobody died: the same
    # Rank 4 (the primary) died: the survivors keep their ranks.
    after = deal([first.role(r) for r in range(4)], [1, 1, 1, 2], 1, 2)
    assert after.holders == (2, 3)  # the standby holds the shard: it is the primary, and host 2 gets the standby
    # Down to two members (no room for a standby): the surviving standby still becomes the primary.
    assert deal([(0, 1), T], [1, 1], 1, 2).holders == (0,)


def test_a_retiring_primary_hands_its_shard_to_a_staying_member():
    before = deal([T] * 4, [1, 1, 2, 2], shards=1, copies=2)
    assert before.holders == (3, 1)
    # Ranks 1 and 3 (both copies) retire; 0 and 2 stay: one of them must take the shard before they go.
    want = handoff(before, [1, 1, 2, 2], [(0, 0), (2, 1)], 100, 1, 2)
    assert want == {0: [], 2: [(0, 100)]}
    # The standby retires alone: the primary keeps its shard, and the new standby, on the host left without an
    # aggregator (rank 0's: spreading over hosts comes before sparing rank 0), takes a copy first.
    assert handoff(before, [1, 1, 2, 2], [(0, 0), (2, 1), (3, 2)], 100, 1, 2) == {0: [(0, 100)], 2: [], 3: [(0, 100)]}


def test_too_few_members_drop_the_standbys_then_shards_and_one_worker_holds_everything():
    assert deal([T] * 3, [1, 1, 1], shards=2, copies=2).holders == (2, 1)  # 2 shards, no standby
    assert deal([T] * 2, [1, 1], shards=2, copies=2) == Layout(2, (1,), 1, 1)
    assert deal([T], [1], 2, 2) == Layout.single()


@pytest.mark.parametrize("overrides, message", [
    (["trainer.shard=optimizer"], "topology=parameter_server shards the optimizer state over its aggregators"),
    (["trainer.grad_clip=1.0"], "topology=parameter_server does not run trainer.grad_clip"),
    (["trainer.precision=16"], "topology=parameter_server does not run float16's loss scaling"),
])
def test_what_parameter_servers_refuse(overrides, message):
    with pytest.raises(ElasticFlowError, match=message):
        validate(compose(str(REPO / "models" / "digits_mlp.py"), ["topology=parameter_server", *overrides]))


# ---------------------------------------------------------------------- runs against the 1-worker reference
@pytest.fixture(scope="module")
def reference(one_worker):
    return one_worker("optimizer=adam", "optimizer.lr=0.01", here=True)


def roles(run) -> list:
    return [e for e in events(run) if e["event"] == "roles"]


def test_two_trainers_and_an_aggregator_pair_end_on_one_worker_with_its_adam_state(tmp_path, reference):
    run = tmp_path / "run"
    train_ok(run, *PS, "launcher.workers=4", "topology.replica=2", "optimizer=adam", "optimizer.lr=0.01")
    assert_equivalent(run, reference)  # parameters and the Adam moments, which only the aggregators held
    first = roles(run)[0]
    assert len(first["primaries"]) == 1 and len(first["standbys"]) == 1 and len(first["trainers"]) == 2
    assert "optimizer/hidden/W/exp_avg" in ckpt.load(ckpt.latest(run / "checkpoints"))


def test_a_killed_primary_costs_no_step_and_its_standby_takes_over(tmp_path, reference):
    run = tmp_path / "run"
    proc = start(run, *PS, "launcher.workers=5", "topology.replica=2", "optimizer=adam", "optimizer.lr=0.01",
                 env={"EF_PROBE_PAUSE": "25:2.0", "EF_PROBE_KILL": "0:45:reduction"})
    wait_for(lambda: logged_step(run) >= 23, 120, "step 23")  # logged as step 24 reduces
    first = roles(run)[0]
    victim = next(m for m in members(run) if m["worker_id"] == first["primaries"][0])
    os.kill(victim["pid"], signal.SIGKILL)  # the primary, while the trainers sit in step 25's forward
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(run, reference)
    assert not [e for e in events(run) if e["event"] == "fell_back"]  # no checkpoint was needed
    recovered = [e for e in events(run) if e["event"] == "recovered"]
    assert len(recovered) == 2 and all(e["steps_redone"] <= 1 for e in recovered), recovered
    after = roles(run)[1]
    assert after["primaries"] == first["standbys"]  # the standby holds the shard: it is the primary now
    assert after["standbys"] and after["standbys"][0] in first["trainers"]  # a trainer became the new standby
    assert after["moved"] > 0  # the shard was copied to it
    world = {r["step"]: r["world_size"] for r in metrics(run) if "loss" in r}
    assert world[1] == 5 and world[60] == 3  # the primary, then rank 0 (a trainer, in the votes' sum)


def test_without_a_standby_a_killed_aggregator_falls_back_to_the_last_checkpoint(tmp_path, reference):
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 25)
    proc = start(run, *PS, "launcher.workers=3", "optimizer=adam", "optimizer.lr=0.01",
                 env={"EF_PROBE_LIMIT": str(limit.path)})
    wait_for(lambda: logged_step(run) >= 23, 120, "step 23", proc=proc)  # logged as step 24 reduces
    # Step 20's save is written in the background: on a loaded machine it may commit after step 24. The trainers
    # wait at the limit (step 25) until it has, so that it is the newest checkpoint when the shard is lost.
    wait_for(lambda: "step_20" in saved(run), 120, "step 20's checkpoint committed", proc=proc)
    first = roles(run)[0]
    victim = next(m for m in members(run) if m["worker_id"] == first["primaries"][0])
    os.kill(victim["pid"], signal.SIGKILL)
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(run, reference, redone=True)  # steps 21-24 were logged twice: trained, lost, trained again
    fell = [e for e in events(run) if e["event"] == "fell_back"]
    assert len(fell) == 1 and fell[0]["step"] == 20, fell  # the shard's only copy died: back to step 20


def test_parameter_server_and_ring_checkpoints_resume_under_each_other(tmp_path, reference):
    a = tmp_path / "a"
    train_ok(a, *PS, "launcher.workers=3", "optimizer=adam", "optimizer.lr=0.01", "trainer.max_steps=30")
    b = tmp_path / "b"  # the ring, on one worker, from the aggregators' checkpoint
    train_ok(b, "optimizer=adam", "optimizer.lr=0.01", f"resume={ckpt.latest(a / 'checkpoints')}",
             "trainer.max_steps=45", "checkpoint.interval.steps=15")
    c = tmp_path / "c"  # and back to parameter servers, on four workers
    train_ok(c, *PS, "launcher.workers=4", "optimizer=adam", "optimizer.lr=0.01",
             f"resume={ckpt.latest(b / 'checkpoints')}")
    assert_equivalent(c, reference, records=False)  # c logged only the steps after b's checkpoint


# ---------------------------------------------------------------------- models with buffers, both backends, scaling
# torch: a primary and its standby (workers 3 and 2) and two trainers. TensorFlow: one aggregator (worker 2) and
# two trainers -- each TF worker spends seconds importing TensorFlow, and the standby's copy is the torch
# case's to prove (the shard is a flat vector, the same on either backend); what TF adds is its variables.
@pytest.mark.parametrize("kind, workers, replica", [("torch_bn", 4, 2), ("keras_bn", 3, 1)])
def test_batchnorm_and_dropout_models_with_a_trainer_killed_equal_one_worker(tmp_path, one_worker, kind, workers,
                                                                             replica):
    """BatchNorm statistics (the aggregators' are reconciled with contributions of nothing) and dropout masks
    (drawn per micro-batch), on torch and on TensorFlow, whose variables take the pulled parameters back."""
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    ref = exact_reference(one_worker, kind)
    train_exact(run, kind, *PS, f"launcher.workers={workers}", f"topology.replica={replica}",
                env={"EF_PROBE_KILL": "1:23:reduction", "EF_PROBE_DUMP": str(dumps)})
    assert_equivalent(run, ref)
    first = roles(run)[0]
    assert len(first["primaries"] + first["standbys"]) == replica and 1 in first["trainers"], first
    assert_replicas_hold_the_checkpoint(run, dumps, kind)  # trainers and aggregators alike
    assert len(list(dumps.glob("*.npz"))) == workers - 1  # the aggregators and the trainer left


def test_a_scale_up_adds_trainers_and_a_scale_down_retires_trainers_before_aggregators(tmp_path, reference):
    run, pace = tmp_path / "run", tmp_path / "pace"
    pace.touch()  # slow steps while the job scales; lifted once it runs with three
    proc = start(run, *PS, "launcher.workers=4", "launcher.max_workers=5", "topology.replica=2", "optimizer=adam",
                 "optimizer.lr=0.01", env={"EF_PROBE_SLEEP": "0.3", "EF_PROBE_PACE": str(pace)})
    wait_for(lambda: logged_step(run) >= 5, 120, "step 5")
    assert "reached" in scale(run, 5).stdout  # the joiner becomes a trainer: every role is filled
    wait_for(lambda: len(roles(run)) >= 2, 60, "the roles of five")
    # The two last-joined are worker 4 (the joiner) and worker 3, the primary: the agent retires trainers first
    # (each worker publishes its role), so workers 4 and 1 go and no shard has to move.
    assert "reached" in scale(run, 3).stdout
    wait_for(lambda: any(r.get("world_size") == 3 for r in metrics(run) if "loss" in r), 60, "a step with three")
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(run, reference)
    dealt = roles(run)
    assert dealt[0]["primaries"] == [3] and dealt[0]["standbys"] == [2], dealt
    assert dealt[1]["trainers"] == [0, 1, 4] and dealt[1]["primaries"] == [3], dealt
    last = dealt[-1]
    assert (last["primaries"], last["standbys"], last["trainers"], last["moved"]) == ([3], [2], [0], 0), dealt
    assert sorted(e["worker"] for e in events(run) if e["event"] == "retired") == [1, 4]
    assert not [e for e in events(run) if e["event"] == "fell_back"]
