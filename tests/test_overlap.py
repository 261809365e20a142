"""Gradient buckets reduced while backward runs (comm.bucket_mb): the same updates as one reduction,
and the same recovery when a worker dies with buckets in flight.

Each run ends on the 1-worker run's model (harness.assert_equivalent): float32 sums over another number of
workers (or another split of the buffer) round differently in the last bits; one worker with buckets sums
exactly as without, to the bit.
"""
from pathlib import Path

import numpy as np
import pytest

from harness import assert_equivalent, cli, final_state, metrics, train

PROBE = Path(__file__).parent / "models" / "overlap_probe.py"
COMMON = ["trainer.global_batch_size=64", "trainer.max_steps=30", "trainer.log_every=1", "optimizer.lr=0.1",
          "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5", "elastic.wait_s=30"]


@pytest.fixture(scope="module")
def reference(one_worker):
    run = one_worker("comm.bucket_mb=null", model=PROBE, common=["trainer.progress=false", *COMMON])
    assert any("weight" in k for k in final_state(run)), "a model with weights to compare"
    return run


def test_buckets_on_one_worker_are_bit_identical(tmp_path, reference):
    train(PROBE, tmp_path / "run", *COMMON, "comm.bucket_mb=0.1")
    assert_equivalent(tmp_path / "run", reference, rtol=0)


def test_three_buckets_on_three_workers_match_one_reduction(tmp_path, reference):
    train(PROBE, tmp_path / "b", *COMMON, "comm.bucket_mb=0.1", "launcher.workers=3")
    train(PROBE, tmp_path / "n", *COMMON, "comm.bucket_mb=null", "launcher.workers=3")
    assert_equivalent(tmp_path / "b", tmp_path / "n")
    assert_equivalent(tmp_path / "b", reference)  # the losses too


@pytest.mark.parametrize("kill", ["1:12:3", "2:12:1", "0:20:0", "1:8:reduction"],
                         ids=["first-bucket-not-started", "two-buckets-in-flight", "rank0-last-layer",
                              "during-the-last-bucket"])
def test_a_kill_with_buckets_in_flight_ends_on_the_one_worker_parameters(tmp_path, reference, kill):
    run = tmp_path / "run"
    train(PROBE, run, *COMMON, "comm.bucket_mb=0.1", "launcher.workers=3", env={"EF_OVERLAP_KILL": kill})
    assert_equivalent(run, reference)
    worlds = [r["world_size"] for r in metrics(run) if "loss" in r]
    assert worlds[0] == 3 and worlds[-1] == 2


class RecordingGroup:
    """A 2-member group that sums nothing (the peer's values are zeros) and records when each
    bucket's allreduce started: during backward (hooks) or after it (reduce_step)."""

    def __init__(self):
        self.events = []

    def allreduce_start(self, tensor):
        self.events.append(("start", tensor.numel()))
        return tensor

    def wait(self, work):
        self.events.append(("wait", work.numel()))


def test_buckets_start_while_backward_runs_in_order_and_the_last_carries_the_votes():
    import torch
    from types import SimpleNamespace

    from elasticflow.backends import torch as backend
    from elasticflow.optim import SGD
    from elasticflow.replica.replica import Replica

    cfg = SimpleNamespace(seed=0)
    probe = {}
    exec(compile(PROBE.read_text(), str(PROBE), "exec"), probe)
    engine = backend.Engine(probe["model"](cfg), lambda x, y, params: probe["forward"](x, y, params), SGD(0.1))
    group = RecordingGroup()
    member = SimpleNamespace(group=group, generation=1, latest_generation=1, world=2, rank=0, agent_lost=False)
    replica = Replica(member, engine, None, None, bucket_mb=0.1)
    x, y = (torch.from_numpy(a[:16]) for a in probe["data"](cfg))
    sizes = [hi - lo for lo, hi in engine.buckets(int(0.1 * 2**20))]
    assert len(sizes) == 3 and sum(sizes) == engine.num_params

    engine.zero_grad()
    engine.accumulate((x, y), 0.5)              # an earlier micro-batch: nothing starts
    assert group.events == []
    replica.begin_backward()
    engine.accumulate((x, y), 0.5)              # the last: the first two buckets start inside backward
    assert group.events == [("start", sizes[0]), ("start", sizes[1])]
    scalars, agreed, _ = replica.reduce_step([1.5], False)
    assert group.events[2:] == [("start", sizes[2] + 5), ("wait", sizes[0]), ("wait", sizes[1]),
                                ("wait", sizes[2] + 5)]  # the scalar and four votes
    assert scalars == [1.5] and not agreed.interrupt  # the votes rode in the last bucket (peer: zeros here)

    group.events.clear()                        # an empty share: no backward, every bucket at reduce time
    replica.reduce_step([0.0], False)
    assert [e[0] for e in group.events] == ["start", "start", "start", "wait", "wait", "wait"]


def test_a_negative_bucket_size_is_refused(tmp_path):
    proc = cli(["train", PROBE, f"hydra.run.dir={tmp_path}", "comm.bucket_mb=-1"])
    assert proc.returncode == 2 and "error: comm.bucket_mb must be a size in MiB >= 0, got -1" in proc.stderr
    assert "hint:" in proc.stderr


class DoublingGroup:
    """A 2-member group whose peer holds the same values: an allreduce doubles the tensor in place."""

    def __init__(self):
        self.reduced = []

    def allreduce_start(self, tensor):
        self.reduced.append(tensor)
        return tensor.mul_(2)

    def wait(self, work):
        pass


def test_the_step_reduces_the_gradient_where_it_lies_with_the_votes_and_buffers_after_it():
    import torch
    from types import SimpleNamespace

    from elasticflow.backends import torch as backend
    from elasticflow.optim import SGD
    from elasticflow.replica.replica import Agreed, Replica

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    engine = backend.Engine(net, lambda x, y, params: torch.nn.functional.cross_entropy(params(x), y), SGD(0.1))
    group = DoublingGroup()
    member = SimpleNamespace(group=group, generation=3, latest_generation=3, world=2, rank=0, agent_lost=False)
    replica = Replica(member, engine, None, None)
    engine.zero_grad()
    engine.accumulate((torch.randn(16, 8), torch.randint(0, 3, (16,))), 1.0)
    grad = engine.grad_view()
    before = grad.clone()
    buffers = np.arange(9, dtype=np.float64) / 4  # BatchNorm1d(4): mean, var, count
    scalars, agreed, summed = replica.reduce_step([1.25, 0.5], False, buffers)

    (reduced,) = group.reduced  # one allreduce, on the gradient's own memory: nothing copied in or out
    assert reduced.data_ptr() == grad.data_ptr() and reduced.numel() == engine.num_params + 2 + 4 + 9
    assert torch.equal(grad, before * 2)
    assert scalars == [2.5, 1.0] and agreed == Agreed()  # generation 3 on both members: no change
    np.testing.assert_array_equal(summed, buffers * 2)


def test_on_tensorflow_every_bucket_starts_once_the_gradient_is_complete_and_is_reduced_where_it_lies():
    tf = pytest.importorskip("tensorflow")
    from types import SimpleNamespace

    from elasticflow import ops
    from elasticflow.optim import SGD
    from elasticflow.replica.replica import Replica

    rng = np.random.default_rng(0)
    model = {"hidden": {"W": rng.normal(0, 0.3, (32, 256)).astype(np.float32), "b": np.zeros(256, np.float32)},
             "out": {"W": rng.normal(0, 0.1, (256, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}}

    def forward(x, y, params):
        h = ops.tanh(x @ params["hidden"]["W"] + params["hidden"]["b"])
        return ops.cross_entropy(h @ params["out"]["W"] + params["out"]["b"], y)

    class Group(RecordingGroup):  # the peer holds the same values: a reduction doubles them in place
        def allreduce_start(self, tensor):
            super().allreduce_start(tensor)
            return tensor.mul_(2)

    with ops.using("tensorflow") as tfb:
        engine = tfb.Engine(model, forward, SGD(0.1))
        group = Group()
        member = SimpleNamespace(group=group, generation=1, latest_generation=1, world=2, rank=0, agent_lost=False)
        replica = Replica(member, engine, None, None, bucket_mb=1024 / 2**20)
        sizes = [hi - lo for lo, hi in engine.buckets(1024)]
        assert sizes == [4 + 256 * 4, 256, 32 * 256]  # whole parameters, the last ones first
        x, y = rng.normal(size=(16, 32)).astype(np.float32), rng.integers(0, 4, 16)
        engine.zero_grad()
        replica.begin_backward()  # nothing to arm: the tape gives every gradient at once
        engine.accumulate((tf.constant(x), tf.constant(y)), 1.0)
        assert group.events == []
        before = engine.grad_view().clone()
        scalars, agreed, _ = replica.reduce_step([0.75], False)
        assert group.events == [("start", sizes[0]), ("start", sizes[1]), ("start", sizes[2] + 5),
                                ("wait", sizes[0]), ("wait", sizes[1]), ("wait", sizes[2] + 5)]
        assert scalars == [1.5] and agreed.membership is False  # generation 1 on both members
        # What the next update reads: TensorFlow's own gradient variable, every bucket doubled.
        np.testing.assert_array_equal(engine.flat_grad.numpy(), before.numpy() * 2)
