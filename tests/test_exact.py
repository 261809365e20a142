"""The model one worker would have trained, for models with cross-sample state and randomness
(BatchNorm, dropout), whatever the membership: real processes killed and joined mid-run.

With ``trainer.micro_batch_size`` set, the micro-batch is the unit of work: its BatchNorm statistics and
its dropout mask are the same for any number of workers, and the buffers are reconciled every step so
every replica holds one worker's running statistics. Each run ends on the 1-worker run's parameters and
buffers (harness.assert_equivalent: per tensor, relative difference <= 1e-5).

The torch models take the kill and the scale-up in a job each; each TensorFlow model takes both in one job
(a kill from two to one, then a worker joins): every TF worker spends seconds importing TensorFlow, and
the kill and the join prove on TF, in one run, what they prove on torch in two.

The last section checks trainer.reproducible's sums in-process (fast): what docs/exactness.md says of their
accuracy, with its counterexamples, the term limit's arithmetic and the squared norm's exactness.
"""
import functools
import math
import random
from fractions import Fraction

import pytest
import torch

from harness import (EXACT_KINDS, Limit, assert_equivalent, assert_replicas_hold_the_checkpoint, events,
                     exact_reference, final_state, finish, logged_step, metrics, scale, start_exact, train_exact,
                     wait_for, workers, world_sizes)

from elasticflow.errors import ElasticFlowError
from elasticflow.replica.exact_sum import (MAX_TERMS, ReproducibleSum, SquaresSum, check_terms,
                                           sum_squares_reproducibly)
from elasticflow.replica.sum_kernels import _MASK, OWN_WINDOW_MULTIPLIER, W

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


# ---------------------------------------------------------------- the sums' numerics (in-process, fast)
# trainer.reproducible's sums (elasticflow/replica/exact_sum.py) are reproducible, not exact: the cases
# docs/exactness.md quotes, the bound that does hold, the term limit, and the squared norm's accuracy.


def _summed(*terms: float) -> float:
    acc = ReproducibleSum(1)
    for t in terms:
        acc.add(torch.tensor([t], dtype=torch.float32))
    return float(acc.values()[0])


def test_the_sum_rounds_twice_to_float64_then_float32_not_once():
    terms = [2.0 ** 51] * 4 + [2.0 ** 29, 1.0]  # window 1: its low bin counts units of 1, so the bins hold it all
    exact = sum(map(Fraction, terms))
    assert exact == 2 ** 53 + 2 ** 29 + 1
    got = _summed(*terms)
    assert got == 2.0 ** 53 + 2.0 ** 29  # float64's 53 bits drop the 1 (a tie, to even)
    correctly_rounded = float(torch.tensor(2.0 ** 53 + 2.0 ** 30).float())  # the exact sum is above float32's half-way
    assert float(torch.tensor(got).float()) == 2.0 ** 53 != correctly_rounded  # the half-way point, to even


def test_a_term_below_the_window_is_dropped_where_float32_keeps_it():
    assert _summed(1.0, -1.0, 2.0 ** -32) == 0.0
    sequential = torch.tensor(1.0) + torch.tensor(-1.0) + torch.tensor(2.0 ** -32)
    assert float(sequential) == 2.0 ** -32  # float32 in order is exact here: the mode is not never-worse per case


def test_the_error_bound_that_holds_terms_times_2_to_the_minus_26_of_the_largest():
    g = torch.Generator().manual_seed(3)
    count, n = 16, 2000
    terms = torch.randn(count, n, generator=g) * torch.exp2(torch.randint(-60, 40, (count, n), generator=g).float())
    acc = ReproducibleSum(n)
    for t in terms:
        acc.add(t)
    truth = [math.fsum(col) for col in terms.double().T.tolist()]  # float64 of the exact sum, for each element
    error = (acc.values() - torch.tensor(truth, dtype=torch.float64)).abs()
    bound = count * 2.0 ** -W * terms.abs().max(0).values.double() + 2.0 ** -52 * torch.tensor(truth).abs()
    assert (error <= bound).all()
    assert (error > 0).any()  # not vacuous: truncation shows


def test_the_term_limit_is_checked_before_a_bin_can_wrap():
    assert MAX_TERMS * _MASK <= 2 ** 63 - 1 < (MAX_TERMS + 1) * _MASK  # the bound's arithmetic
    check_terms(MAX_TERMS)
    check_terms(MAX_TERMS // 3, world=3)
    with pytest.raises(ElasticFlowError, match=r"exceed the .* an int64 bin can sum without wrapping"):
        check_terms(MAX_TERMS // 3 + 1, world=3)
    acc = ReproducibleSum(2)
    acc.terms = MAX_TERMS - 2  # as if that many had been added: no 2^32 calls needed
    acc.add(torch.ones(2))
    acc.add_rows(torch.ones(1, 2))
    with pytest.raises(ElasticFlowError) as err:
        acc.add(torch.ones(2))
    assert err.value.hint and "\n" not in str(err.value)  # one line, with a hint
    with pytest.raises(ElasticFlowError):
        check_terms(MAX_TERMS + 1)
    acc.clear()
    assert acc.terms == 0


def test_the_largest_bins_at_the_limit_do_not_wrap():
    """MAX_TERMS terms of the largest magnitude a bin takes sum to at most int64's largest, in torch's int64."""
    top = torch.tensor([_MASK], dtype=torch.int64)
    assert int((top * MAX_TERMS)[0]) == _MASK * MAX_TERMS > 0
    assert int((-top * MAX_TERMS)[0]) == -_MASK * MAX_TERMS


def test_a_float32_terms_window_by_multiply_and_shift_is_floor_division_for_every_exponent():
    """deposit_float32 finds a term's window without a division: for all 256 biased exponents."""
    for biased in range(256):
        assert ((biased + 5 * W - 127) * OWN_WINDOW_MULTIPLIER >> 16) - 5 == (biased - 127) // W


class _Summed:
    """A group whose allreduce_ writes a sum precomputed from every member's tensor (members in one process)."""

    def __init__(self, tensors: list):
        self.world, self.total = len(tensors), sum(t.clone() for t in tensors)

    def allreduce_(self, t, op="sum"):
        t.copy_(self.total)


def _exact_squares(t: torch.Tensor) -> float:
    """The correctly rounded float64 of the exact sum of the squares of float32 ``t`` (float64 squares are exact)."""
    return math.fsum(v * v for v in t.double().tolist())


@pytest.mark.parametrize("scale", [-8, -4, 0, 4, 8])
def test_the_squared_norm_is_exact_at_2_to_the_20_elements_at_any_scale(scale):
    """A gradient with one outlier: the small squares lay below a window fixed by absolute exponents (the old sum
    was off by 1.35e-4 at scale 0, 9e-7 at 2^4), and their share grows with the element count."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g) * 2.0 ** -16
    x[0] = 1.0
    x *= 2.0 ** scale
    assert float(sum_squares_reproducibly(x).values()[0]) == _exact_squares(x)


def test_the_squared_norm_is_exact_over_float32s_range_and_the_same_however_the_vector_is_cut():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-149, 127, (n,), generator=g).float())
    x[:10] = 1e-45  # subnormals
    x[10:20] = 0.0
    whole = float(sum_squares_reproducibly(x).values()[0])
    assert whole == _exact_squares(x)
    rng = random.Random(0)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, n), 3))
        parts = [sum_squares_reproducibly(x[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]
        group = _Summed([p._digits() for p in parts])
        for p in parts:
            p.allreduce(group)
        assert all(float(p.values()[0]) == whole for p in parts)


def test_the_squared_norm_has_no_term_limit_and_says_nan_for_a_non_finite_element():
    """Sums as large as 2^33 of the largest squares fold into an unbounded integer and travel as 31-bit digits a
    group of 3 adds without wrapping (the old sum wrapped near 2^33 terms)."""
    biggest = float(torch.finfo(torch.float32).max)
    members = []
    for _ in range(3):
        acc = SquaresSum()
        acc.add(torch.tensor([biggest]))
        acc.total *= 2 ** 33  # as if 2^33 such squares had been added
        members.append(acc)
    group = _Summed([m._digits() for m in members])
    assert int(group.total[:-1].max()) < 3 * 2 ** 31
    members[0].allreduce(group)
    want = Fraction(biggest) ** 2 * 3 * 2 ** 33
    assert members[0].total * Fraction(1, 2 ** 300) == want
    assert float(members[0].values()[0]) == float(want)
    bad = SquaresSum()
    bad.add(torch.tensor([1.0, float("nan")]))
    assert math.isnan(float(bad.values()[0]))
    inf = sum_squares_reproducibly(torch.tensor([float("inf"), 2.0]))
    assert math.isnan(float(inf.values()[0]))
