"""trainer.reproducible: the bits one worker trains, whatever the membership (docs/exactness.md).

Every sum across micro-batches and workers is exact (elasticflow/replica/exact_sum.py), each micro-batch runs
on a fixed thread count with deterministic kernels, so a run ends on the 1-worker run's tensors with ``==``
(harness.assert_bitwise: parameters, BatchNorm buffers, AdamW's slots, every step's loss, the TrainState and
the evaluations). The model: tests/models/exact_probe.py's CNN with BatchNorm (an EMA and a cumulative
average) and dropout, trained with AdamW. Without the mode, 2 workers already differ from 1 in the last bits
(1e-7 after 40 steps).
"""
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import (EXACT, EXACT_COMMON, Limit, assert_bitwise, cli, events, exact_overrides, finish,
                     lose_join_retire, metrics, start, start_exact, train_exact, wait_for, world_sizes)

from elasticflow.replica.exact_sum import ONE_INT64_TERMS, ReproducibleSum
from elasticflow.replica.sum_kernels import W

# 30 steps, not the exactness tests' 60: any bit that differs at any step is still there at the end (the long
# horizon, 2,000 steps under kills, is scripts/soak/long_exact.py's and scripts/soak/chaos.py --reproducible's)
MODE = ["trainer.reproducible=true", "optimizer=adamw", "optimizer.lr=0.01", "trainer.max_steps=30"]


@pytest.fixture(scope="module")
def torch_reference(one_worker):
    return one_worker(*exact_overrides("torch_bn"), *MODE, model=EXACT, common=EXACT_COMMON, here=True)


# ---------------------------------------------------------------- the sums
def _terms(count: int, n: int, seed: int) -> list:
    """COUNT float32 vectors of N elements spanning 60 binades, with cancellation (a gradient's worst case)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-45, 15, (count, n), generator=g).float())
    return list((torch.randn(count, n, generator=g) * scale).float())


class _Members:
    """A group of ``world`` members in threads of one process: each collective waits for all of them, then every
    member reads the MAX or SUM of all their tensors (what gloo gives them). ``wire`` records what was sent."""

    def __init__(self, world: int):
        self.world, self.barrier, self.sent, self.wire = world, threading.Barrier(world), {}, []

    def allreduce_(self, t: torch.Tensor, op: str = "sum") -> None:
        rank = threading.current_thread().rank
        self.sent[rank] = t.clone()
        self.barrier.wait()
        if rank == 0:
            self.wire.append((t.dtype, tuple(t.shape)))
        stacked = torch.stack([self.sent[r] for r in range(self.world)])
        self.barrier.wait()
        t.copy_(stacked.amax(0) if op == "max" else stacked.sum(0))


def _grouped(terms: list, groups: list, wire: list = None) -> torch.Tensor:
    """Each group added (in its order) into a member's accumulator of its own, then summed over the members as
    ``ReproducibleSum.allreduce`` sums them (a real MAX and SUM in threads); returns the members' common values."""
    if len(groups) == 1:
        acc = ReproducibleSum(terms[0].numel())
        for i in groups[0]:
            acc.add(terms[i])
        return acc.values()
    members, got = _Members(len(groups)), {}

    def member(rank: int) -> None:
        threading.current_thread().rank = rank
        acc = ReproducibleSum(terms[0].numel())
        for i in groups[rank]:
            acc.add(terms[i])
        acc.allreduce(members)
        got[rank] = acc.values()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == list(range(len(groups)))
    for r in got:
        assert torch.equal(got[r].nan_to_num(7.0), got[0].nan_to_num(7.0))
    if wire is not None:
        wire.extend(members.wire)
    return got[0]


def test_exact_sums_are_the_same_bits_in_any_order_and_grouping_and_closer_than_float32():
    terms = _terms(12, 4000, seed=0)
    one = _grouped(terms, [list(range(12))])
    rng = random.Random(0)
    for _ in range(25):
        order = rng.sample(range(12), 12)
        cuts = sorted(rng.sample(range(1, 12), rng.randint(1, 6)))
        groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, 12])]
        assert torch.equal(_grouped(terms, groups), one), groups
    # Accuracy against float64's sum: each term loses at most one unit of 2^-26 of the largest term (bits below
    # the window), where float32 accumulation in order rounds each partial sum to 2^-24 of itself.
    stacked = torch.stack(terms).double()
    truth = stacked.sum(0)
    sequential = terms[0].clone()
    for t in terms[1:]:
        sequential += t
    error, float32_error = (one - truth).abs(), (sequential.double() - truth).abs()
    assert (error <= 12 * 2.0 ** -W * stacked.abs().max(0).values).all()
    assert error.max() < float32_error.max() / 50 and error.mean() < float32_error.mean() / 50


def _adversarial(count: int, n: int, rng: random.Random) -> list:
    """Terms no gradient is kind enough to give: float32's whole range in one element (subnormals, the largest
    finite, exact cancellations of the largest against itself), zeros, and now and then an infinity or a NaN."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    mantissa = torch.randn(count, n, generator=g)
    exponent = torch.randint(-149, 128, (count, n), generator=g).float()
    terms = (mantissa * torch.exp2(exponent)).float()  # inf where the product overflows: a few
    terms[torch.rand(count, n, generator=g) < 0.05] = 0.0
    terms[torch.rand(count, n, generator=g) < 0.02] = 1e-45
    big = torch.rand(count, n, generator=g) < 0.05
    terms[big] = torch.finfo(torch.float32).max * torch.sign(torch.randn(int(big.sum()), generator=g))
    if rng.random() < 0.5:
        terms[rng.randrange(count), rng.randrange(n)] = float("nan")
    return list(terms)


@pytest.mark.parametrize("seed", range(6))
def test_many_data_sets_in_random_groupings_over_up_to_eight_members_give_one_accumulators_bits(seed):
    """Random data sets (gradient-like, and adversarial exponent spreads), each cut among 1 to 8 members in a
    random order: every grouping sums, through the real MAX and SUM, to the one accumulator's bits."""
    rng = random.Random(seed)
    for case in range(4):
        count, n = rng.randint(2, 24), rng.randint(1, 300)
        terms = _adversarial(count, n, rng) if case % 2 else _terms(count, n, seed=rng.randrange(1 << 30))
        one = _grouped(terms, [list(range(count))])
        for _ in range(3):
            order = rng.sample(range(count), count)
            world = rng.randint(1, min(8, count))
            cuts = sorted(rng.sample(range(1, count), world - 1))
            groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, count])]
            assert torch.equal(_grouped(terms, groups).nan_to_num(7.0), one.nan_to_num(7.0)), (seed, case, groups)


def test_term_counts_at_the_one_int64_bound_fit_and_one_more_takes_the_two_int64_wire_with_the_same_bits():
    """2^11 terms of the largest magnitude a window holds (2^52 - 2^28 units of its low bin) sum to 2^63 - 2^39:
    they fit one int64 per element on the wire, exactly. A member with one term more makes the members agree on
    the two-int64 wire (17 bytes) instead: the same integers, the same bits."""
    top = 2.0 ** 52 - 2.0 ** 28  # the largest float32 below 2^52: window 1, whose low bin counts units of 1
    assert ONE_INT64_TERMS == 2048 and (2048 * (2 ** 52 - 2 ** 28)) < 2 ** 63
    for sign in (1.0, -1.0):
        terms = [torch.tensor([sign * top, sign * 2.0 ** 30, -sign * 3.0], dtype=torch.float32)] * 2048
        wire = []
        got = _grouped(terms, [list(range(r * 512, r * 512 + 512)) for r in range(4)], wire)
        assert [dtype for dtype, _ in wire] == [torch.int8, torch.int64] and wire[1][1] == (3,)  # one int64 each
        assert got.tolist() == [sign * float(2048 * (2 ** 52 - 2 ** 28)), sign * 2.0 ** 41, -sign * 6144.0]
        wire = []
        more = terms + [torch.zeros(3)]  # one term more, on member 0: 513 terms there, 4 x 2^10 > 2^11
        groups = [list(range(513))] + [list(range(513 + r * 512, 513 + r * 512 + 512)) for r in range(3)]
        assert torch.equal(_grouped(more, groups, wire), got)
        assert wire[1][1] == (2, 3)  # both bins: 16 bytes an element beside the window


def test_the_one_int64_and_two_int64_wires_give_the_same_bits():
    """The wire's form is a transport: forced each way, the same sums to the bit, on data sets with spreads."""
    from elasticflow.replica import exact_sum

    rng = random.Random(11)
    for _ in range(4):
        terms = _adversarial(12, 200, rng)
        groups = [list(range(0, 5)), list(range(5, 9)), list(range(9, 12))]
        one_wire, two_wire = [], []
        a = _grouped(terms, groups, one_wire)
        saved = exact_sum.ONE_INT64_TERMS
        exact_sum.ONE_INT64_TERMS = 0
        try:
            b = _grouped(terms, groups, two_wire)
        finally:
            exact_sum.ONE_INT64_TERMS = saved
        assert one_wire[1][1] == (200,) and two_wire[1][1] == (2, 200)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _built() -> None:
    """The compiled kernels on disk (the background builder's work, done here and waited for; cached per machine).
    In a process of its own, as the builder runs: a process that builds a package and then loads it failed to load
    some, the first time (a worker never builds: it loads what the builder left)."""
    import subprocess
    import sys

    from elasticflow.replica import sum_kernels

    folder = sum_kernels._Kernels.folder()
    folder.mkdir(parents=True, exist_ok=True)
    if not all(sum_kernels._kernels.path(name).exists() for name in sum_kernels._Kernels.names):
        code = f"from elasticflow.replica.sum_kernels import build; from pathlib import Path; " \
               f"build(Path({str(folder)!r}), {sum_kernels._Kernels.key()!r})"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=900)


class _Alone:
    """A group of one member: the MAX raises every element's window by one (the move a larger term would cause
    on another member), the SUM adds nothing."""
    world = 1

    def allreduce_(self, t, op="sum"):
        if op == "max":
            t[:-1] = torch.where(t[:-1] < 90, t[:-1] + 1, t[:-1])


def test_the_compiled_deposit_gives_the_eager_bits(monkeypatch):
    """A large gradient's terms go through deposit_float32 compiled ahead of time (one loop, any size), four at a
    time through deposit4_float32_, a small one's eager: the same integer arithmetic, the same bits, also for
    zeros, subnormals, infinities and NaNs."""
    from elasticflow.replica import sum_kernels

    _built()
    monkeypatch.setattr(sum_kernels, "_kernels", sum_kernels._Kernels())
    g = torch.Generator().manual_seed(2)
    for n in (4096, 5000):  # two sizes, one package
        terms = [(torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 100, (n,), generator=g).float()))
                 for _ in range(5)]
        terms[0][:40] = 0.0
        terms[1][40:50] = float("inf")
        terms[2][50:60] = float("nan")
        terms[3][60:70] = 1e-45
        eager, compiled = ReproducibleSum(n), ReproducibleSum(n)
        monkeypatch.setattr(sum_kernels, "COMPILE_FROM", 1 << 40)
        for t in terms:
            eager.add(t.float())
        want = eager.values()
        monkeypatch.setattr(sum_kernels, "COMPILE_FROM", 1024)
        for t in terms:  # the first four in one deposit4, the fifth on its own when the sums are read
            compiled.add_later(t.float())
        assert len(compiled._later) == 1
        assert torch.equal(compiled.values().nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(compiled.window, eager.window)  # the bins may split a value otherwise: its sum is the same
        grad = torch.empty(n)  # read into a float32 gradient in one compiled pass: the bits of copy_(values())
        compiled.values_into(grad)
        assert torch.equal(grad.nan_to_num(7.0), want.float().nan_to_num(7.0))
        for acc in (compiled, eager):  # the one-int64 wire's kernels: the bins moved to a window and combined
            monkeypatch.setattr(sum_kernels, "COMPILE_FROM", 1024 if acc is compiled else 1 << 40)
            acc.allreduce(_Alone())
        assert torch.equal(compiled._combined, eager._combined)
        moved = eager.values()
        monkeypatch.setattr(sum_kernels, "COMPILE_FROM", 1024)
        assert torch.equal(compiled.values().nan_to_num(7.0), moved.nan_to_num(7.0))
        compiled.values_into(grad)
        assert torch.equal(grad.nan_to_num(7.0), moved.float().nan_to_num(7.0))
        assert sum_kernels._kernels.loaded.keys() == set(sum_kernels._Kernels.names), "a compiled kernel did not run"


def test_no_compilation_on_the_step_path_without_a_built_kernel(monkeypatch, tmp_path):
    """Where no kernel is built yet, a large sum runs eager at once (the same bits) and starts one build in the
    background, once per process; a failed build leaves the process eager for good."""
    from elasticflow.replica import sum_kernels

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sum_kernels, "_kernels", sum_kernels._Kernels())
    monkeypatch.setattr(sum_kernels, "COMPILE_FROM", 1024)
    started = []
    monkeypatch.setattr(sum_kernels, "start_build", lambda folder, key: started.append((folder, key)))
    acc = ReproducibleSum(4096)
    for _ in range(3):
        acc.add(torch.ones(4096))
    assert started == [(tmp_path / "elasticflow_sums", sum_kernels._Kernels.key())]
    assert (acc.values() == 3.0).all() and not sum_kernels._kernels.loaded
    for name in sum_kernels._Kernels.names:  # what the builder leaves when it cannot compile
        sum_kernels._kernels.path(name).with_suffix(".failed").parent.mkdir(parents=True, exist_ok=True)
        sum_kernels._kernels.path(name).with_suffix(".failed").write_text("the kernels' build failed: no compiler")
    acc.add(torch.ones(4096))
    assert sum_kernels._kernels.off and (acc.values() == 4.0).all() and len(started) == 1


def test_a_non_finite_term_makes_its_element_nan_and_no_other():
    acc = ReproducibleSum(3)
    acc.add(torch.tensor([1.0, float("inf"), 2.0]))
    acc.add(torch.tensor([1e30, 1.0, float("nan")]))
    got = acc.values()
    assert got[0] == float(torch.tensor(1e30)) and got[1].isnan() and got[2].isnan()  # 1.0: below 1e30's window


def test_members_summing_over_a_real_group_get_one_accumulators_bits():
    from torch.distributed import TCPStore

    from elasticflow.distributed.comm.comm import Group

    terms, world = _terms(9, 3000, seed=1), 3
    one = _grouped(terms, [list(range(9))])
    store = TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    got = {}

    def member(rank: int) -> None:
        peer = TCPStore("127.0.0.1", store.port, world + 1, False)
        group = Group(peer, 0, rank, world, timeout_s=60)
        acc = ReproducibleSum(3000)
        for t in terms[rank * 3:rank * 3 + 3][::-1]:  # another order within each member, too
            acc.add(t)
        acc.allreduce(group)
        got[rank] = acc.values()
        group.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == [0, 1, 2]
    for rank in range(world):
        assert torch.equal(got[rank], one)


# ---------------------------------------------------------------- what the mode cannot run with
@pytest.mark.parametrize("setting, says", [
    ("trainer.micro_batch_size=null", "needs trainer.micro_batch_size"),
    ("comm.bucket_mb=4", "pass comm.bucket_mb=null"),
    ("trainer.shard=gradients", "pass trainer.shard=parameters, optimizer or none"),
    ("topology=local_sgd", "topology=local_sgd sums in float32"),
])
def test_what_the_mode_cannot_make_bitwise_is_refused_in_one_line(tmp_path, setting, says):
    out = cli(["train", EXACT, *exact_overrides("torch_bn"), "trainer.reproducible=true",
               "trainer.micro_batch_size=16", setting, f"hydra.run.dir={tmp_path / 'run'}"])
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "hint:" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------- the bits of one worker, end to end
def test_four_workers_end_on_the_one_workers_bits(tmp_path, torch_reference):
    """A micro-batch each (2 and 3 workers: the kill, join and scale-down run below, and the resume)."""
    run = tmp_path / "run"
    train_exact(run, "torch_bn", *MODE, "launcher.workers=4")
    assert world_sizes(run) == [4] * len(world_sizes(run))
    assert_bitwise(run, torch_reference)


def test_a_kill_a_join_and_a_scale_down_in_one_run_end_on_the_one_workers_bits(tmp_path, torch_reference):
    run, limit = tmp_path / "run", Limit(tmp_path / "limit", 12, last=26)
    proc = start_exact(run, "torch_bn", *MODE, "launcher.workers=3", "launcher.max_workers=3",
                       "elastic.timeout_s=90", "elastic.heartbeat_timeout_s=10",
                       env={"EF_PROBE_LIMIT": str(limit.path), "EF_PROBE_KILL": "2:8:reduction"})
    wait_for(lambda: any(e["event"] == "left" for e in events(run)), 120, "the killed worker gone", proc=proc)
    lose_join_retire(run, proc, limit)
    assert_bitwise(run, torch_reference)


def test_a_resume_at_another_world_size_ends_on_the_one_workers_bits(tmp_path, torch_reference):
    run = tmp_path / "run"
    train_exact(run, "torch_bn", *MODE, "launcher.workers=2", "trainer.max_steps=15")
    out = train_exact(run, "torch_bn", *MODE, "launcher.workers=3")  # the same run folder: it resumes
    assert "resumed" in out.lower()
    assert world_sizes(run)[0] == 2 and world_sizes(run)[-1] == 3
    assert_bitwise(run, torch_reference)


def test_sharded_optimizer_state_with_a_kill_ends_on_the_one_workers_bits(tmp_path, torch_reference):
    run = tmp_path / "run"
    train_exact(run, "torch_bn", *MODE, "launcher.workers=3", "trainer.shard=optimizer",
                env={"EF_PROBE_KILL": "1:14:reduction"})
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2
    assert_bitwise(run, torch_reference)


def test_float16_loss_scaling_clipping_groups_and_frozen_weights_with_a_kill_end_on_the_one_workers_bits(
        tmp_path, one_worker):
    """What the mode composes with, at once: float16 with its loss scale, the gradient norm clipped, a parameter
    group with its own learning rate, a frozen convolution; 3 workers, one SIGKILLed at step 12."""
    extra = ["trainer.precision=16", "trainer.grad_clip=0.5", "optimizer.groups=[{params:[10],lr:0.003}]",
             "+model_args.freeze=1"]
    reference = one_worker(*exact_overrides("torch_bn"), *MODE, *extra, model=EXACT, common=EXACT_COMMON,
                           here=True)
    run = tmp_path / "run"
    train_exact(run, "torch_bn", *MODE, *extra, "launcher.workers=3", env={"EF_PROBE_KILL": "2:12:reduction"})
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2
    assert [r["loss_scale"] for r in metrics(run) if "loss" in r] == \
        [r["loss_scale"] for r in metrics(reference) if "loss" in r]
    assert_bitwise(run, reference)


def test_keras_with_batchnorm_and_dropout_ends_on_the_one_workers_bits_across_a_kill(tmp_path, one_worker):
    """2 workers, one SIGKILLed at step 14: TensorFlow's micro-batches give the 1-worker run's bits on either
    member, and after the kill on the survivor alone (sums over 3 and 4 members are the torch tests' above: the
    exact sum is the same code on either backend; each TF worker spends seconds importing TensorFlow)."""
    pytest.importorskip("tensorflow")
    reference = one_worker(*exact_overrides("keras_bn"), *MODE, model=EXACT, common=EXACT_COMMON, record=True)
    run = tmp_path / "run"
    train_exact(run, "keras_bn", *MODE, "launcher.workers=2", env={"EF_PROBE_KILL": "1:14:reduction"})
    assert world_sizes(run)[0] == 2 and world_sizes(run)[-1] == 1
    assert_bitwise(run, reference)


def test_a_transformers_gpt2_with_dropout_and_token_weights_ends_on_the_one_workers_bits_across_a_kill(tmp_path,
                                                                                                        one_worker):
    """A Hugging Face GPT-2 (dropout 0.1 in attention, residuals and embeddings) on ragged text, each micro-batch
    weighted by its target tokens (tests/models/ragged_gpt2.py), AdamW: 3 workers with one SIGKILLed at step 6."""
    pytest.importorskip("transformers")
    gpt2 = Path(__file__).parent / "models" / "ragged_gpt2.py"
    common = ["trainer.global_batch_size=24", "trainer.micro_batch_size=4", "trainer.max_steps=16",
              "trainer.log_every=1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5",
              "trainer.reproducible=true", "+model_args.dropout=0.1", "+model_args.optimizer=adamw"]
    reference = one_worker(model=gpt2, common=common, here=True)
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", env={"EF_LM_KILL": "1:6"}, model=gpt2, common=common)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2
    assert_bitwise(run, reference)


def test_a_transformers_resnet_with_batchnorm_ends_on_the_one_workers_bits(tmp_path, one_worker):
    """A Hugging Face ResNet (7 BatchNorm2d, tests/models/hf_resnet.py) with AdamW: 3 workers against 1. Without the
    mode the two differ (the workers' thread counts alone move BatchNorm's statistics)."""
    pytest.importorskip("transformers")
    resnet = Path(__file__).parent / "models" / "hf_resnet.py"
    common = ["trainer.global_batch_size=32", "trainer.micro_batch_size=8", "trainer.max_steps=12",
              "trainer.log_every=1", "trainer.reproducible=true", "optimizer=adamw", "optimizer.lr=0.01"]
    reference = one_worker(model=resnet, common=common, here=True)
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", model=resnet, common=common)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_bitwise(run, reference)

