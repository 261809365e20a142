"""The model one worker would have trained, for models with cross-sample state and randomness
(BatchNorm, dropout), whatever the membership: real processes killed and joined mid-run.

With ``trainer.micro_batch_size`` set, the micro-batch is the unit of work: its BatchNorm statistics and
its dropout mask are the same for any number of workers, and the buffers are reconciled every step so
every replica holds one worker's running statistics. Each run ends on the 1-worker run's parameters and
buffers (harness.assert_equivalent: per tensor, relative difference <= 1e-5).

The torch models take the kill and the scale-up in a job each; each TensorFlow model takes both in one job
(a kill from two to one, then a worker joins): every TF worker spends seconds importing TensorFlow, and
the kill and the join prove on TF, in one run, what they prove on torch in two.
"""
import functools

import pytest

from harness import (EXACT_KINDS, Limit, assert_equivalent, assert_replicas_hold_the_checkpoint, events,
                     exact_reference, final_state, finish, logged_step, metrics, scale, start_exact, train_exact,
                     wait_for, workers, world_sizes)

# The short names this file (and tests/test_gpu.py, from harness) calls them by.
start, train_ok, final = start_exact, train_exact, functools.partial(final_state, rng=False)


TORCH_KINDS = [kind for kind, backend in EXACT_KINDS.items() if backend == "backend=torch"]
TF_KINDS = [kind for kind in EXACT_KINDS if kind not in TORCH_KINDS]


@pytest.fixture(scope="module")
def reference(request, one_worker):
    """(kind, its cached 1-worker run); each test names its kinds (indirect parametrization)."""
    return request.param, exact_reference(one_worker, request.param)


@pytest.mark.parametrize("reference", TORCH_KINDS, indirect=True)
def test_three_workers_one_killed_mid_step(tmp_path, reference):
    kind, ref = reference
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    dumps.mkdir()
    train_exact(run, kind, "launcher.workers=3", env={"EF_PROBE_KILL": "1:23:reduction", "EF_PROBE_DUMP": str(dumps)})
    sizes = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert sizes[0] == 3 and sizes[-1] == 2
    assert_equivalent(run, ref)
    assert_replicas_hold_the_checkpoint(run, dumps, kind)


@pytest.mark.parametrize("reference", TORCH_KINDS, indirect=True)
def test_two_workers_scaled_to_four(tmp_path, reference):
    kind, ref = reference
    run, dumps, pace, limit = tmp_path / "run", tmp_path / "dumps", tmp_path / "pace", Limit(tmp_path / "limit", 11)
    dumps.mkdir()
    # Training is held still after step 11 (step 10 is logged as step 11 reduces) until both joiners are admitted
    # (however long they take to start), then goes on in slowed steps (0.4 s each) while they enter, at whatever
    # step boundaries they reach: the result must not depend on which. Once a step ran with all four, the pace
    # is lifted.
    proc = start_exact(run, kind, "launcher.workers=2", "launcher.max_workers=4", "elastic.timeout_s=90",
                       "elastic.heartbeat_timeout_s=10",
                       env={"EF_PROBE_SLEEP": "0.4", "EF_PROBE_PACE": str(pace), "EF_PROBE_DUMP": str(dumps),
                            "EF_PROBE_LIMIT": str(limit.path)})
    wait_for(lambda: logged_step(run) >= 10, 120, "step 10", proc=proc)
    scale(run, 4, wait=0)
    wait_for(lambda: len(workers(run)) == 4, 300, "both joiners admitted", proc=proc)
    pace.touch()
    limit.lift()
    wait_for(lambda: 4 in world_sizes(run), 120, "a step with four", proc=proc)
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert 4 in world_sizes(run)
    assert_equivalent(run, ref)
    assert_replicas_hold_the_checkpoint(run, dumps, kind)


@pytest.mark.parametrize("reference", TF_KINDS, indirect=True)
def test_tensorflow_two_workers_one_killed_mid_step_then_one_joins(tmp_path, reference):
    """The two tests above in one TensorFlow job: worker 1 SIGKILLed in step 23's reduction (the epoch's short
    last batch, as above), the survivor held after step 26 until a joiner is admitted, then slowed steps while it
    enters; it ends on the 1-worker model, and both replicas hold its buffers. Two workers and one joiner, not
    three and two: what more members add (micro-batches spread over them, the buffers reconciled, joiners
    entering at different steps) is the same code on either backend, and the torch tests' above."""
    kind, ref = reference
    run, dumps, pace, limit = tmp_path / "run", tmp_path / "dumps", tmp_path / "pace", Limit(tmp_path / "limit", 26)
    dumps.mkdir()
    proc = start_exact(run, kind, "launcher.workers=2", "launcher.max_workers=2", "elastic.timeout_s=90",
                       "elastic.heartbeat_timeout_s=10",
                       env={"EF_PROBE_KILL": "1:23:reduction", "EF_PROBE_SLEEP": "0.4", "EF_PROBE_PACE": str(pace),
                            "EF_PROBE_DUMP": str(dumps), "EF_PROBE_LIMIT": str(limit.path)})
    wait_for(lambda: logged_step(run) >= 25, 180, "step 25", proc=proc)  # past the kill: the survivor alone
    assert world_sizes(run)[0] == 2 and world_sizes(run)[-1] == 1
    scale(run, 2, wait=0)
    wait_for(lambda: len(workers(run)) == 2, 300, "the joiner admitted", proc=proc)
    pace.touch()
    limit.lift()
    wait_for(lambda: world_sizes(run)[-1] == 2, 120, "a step with the joiner", proc=proc)
    pace.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    sizes = world_sizes(run)
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("left") == 1 and kinds.count("joined") == 1, kinds
    assert_equivalent(run, ref)
    assert_replicas_hold_the_checkpoint(run, dumps, kind)
    assert len(list(dumps.glob("*.npz"))) == (2 if kind == "keras_bn" else 0)  # the survivor and the joiner
