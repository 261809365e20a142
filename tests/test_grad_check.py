"""grad_check: the summed gradient's unscale, overflow, non-finite and clipping verdict, on a stand-in engine."""
import math

import numpy as np
import pytest
import torch

from elasticflow.train import grad_check


class Engine:
    """The three Engine calls grad_check makes, over one flat gradient; counts the norm's sync points."""

    def __init__(self, *values):
        self.grad = np.array(values, np.float64)
        self.norms = self.finite_checks = 0

    def grad_norm(self):
        self.norms += 1
        return float(np.linalg.norm(self.grad))

    def grad_finite(self):
        self.finite_checks += 1
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as the engines' sum
            return bool(np.isfinite(self.grad.sum()))

    def scale_grad(self, factor):
        self.grad *= factor


def test_clipping_is_torchs_clip_grad_norm():
    engine = Engine(3.0, 4.0)
    verdict = grad_check.check(engine, 1.0, grad_clip=1.0, scale=None)
    assert verdict == (5.0, False, True)  # the norm before clipping is what the step logs
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    np.testing.assert_allclose(engine.grad, p.grad.numpy(), rtol=1e-12)
    under = Engine(0.3, 0.4)
    assert grad_check.check(under, 1.0, grad_clip=1.0, scale=None).finite
    np.testing.assert_array_equal(under.grad, [0.3, 0.4])  # below the limit: untouched


def test_a_loss_scale_is_divided_out_exactly_and_an_overflow_skips():
    engine = Engine(3.0 * 2**16, 4.0 * 2**16)
    assert grad_check.check(engine, 1.0, grad_clip=None, scale=2.0**16) == (5.0, False, True)
    np.testing.assert_array_equal(engine.grad, [3.0, 4.0])
    overflowed = grad_check.check(Engine(math.inf, 1.0), 1.0, grad_clip=1.0, scale=2.0**16)
    assert overflowed.overflow and not overflowed.finite
    assert overflowed.problem(1.0) == "gradient norm is inf"


def test_no_norm_is_computed_unless_asked_or_when_the_loss_already_says_no():
    plain = Engine(3.0, 4.0)
    assert grad_check.check(plain, 0.5, grad_clip=None, scale=None) == (None, False, True)
    bad_loss = Engine(3.0, 4.0)
    verdict = grad_check.check(bad_loss, math.nan, grad_clip=1.0, scale=None)
    assert not verdict.finite and not verdict.overflow and verdict.problem(math.nan) == "loss is nan"
    assert plain.norms == bad_loss.norms == 0  # no norm taken
    assert (plain.finite_checks, bad_loss.finite_checks) == (1, 0)  # the loss already said no: no read spent
    np.testing.assert_array_equal(bad_loss.grad, [3.0, 4.0])


def test_a_nan_gradient_under_a_finite_loss_is_not_finite_without_clipping_or_scaling():
    for bad in (math.nan, math.inf, -math.inf):
        engine = Engine(3.0, bad)
        verdict = grad_check.check(engine, 0.5, grad_clip=None, scale=None)
        assert verdict == (None, False, False) and engine.finite_checks == 1 and engine.norms == 0
        assert verdict.problem(0.5) == "the summed gradient has NaN or inf values (the loss, 0.5, is finite)"
    assert grad_check.decide(verdict, 0.5, "skip") == ("skip", verdict.problem(0.5), grad_check.BAD_DERIVATIVE)
    stop = grad_check.decide(verdict, 0.5, "stop")
    assert stop.action == "stop" and "sqrt or log at 0" in stop.hint and "on_nonfinite=skip" in stop.hint
    # +inf and -inf in one gradient: their sum is NaN, still caught.
    assert not grad_check.check(Engine(math.inf, -math.inf), 0.5, grad_clip=None, scale=None).finite


def test_the_norm_clipping_takes_is_the_check_no_second_read():
    engine = Engine(3.0, math.nan)
    verdict = grad_check.check(engine, 0.5, grad_clip=1.0, scale=None)
    assert not verdict.finite and not verdict.overflow and (engine.norms, engine.finite_checks) == (1, 0)
    assert math.isnan(engine.grad[1]) and engine.grad[0] == 3.0  # not clipped: nothing is applied anyway
    assert grad_check.decide(verdict, 0.5, "stop").hint == grad_check.DIVERGED  # "gradient norm is nan"
    # A NaN loss says "lower the learning rate", not "look for sqrt(0)".
    nan_loss = grad_check.check(Engine(3.0, 4.0), math.nan, grad_clip=None, scale=None)
    assert grad_check.decide(nan_loss, math.nan, "stop") == ("stop", "loss is nan", grad_check.DIVERGED)


class Shards:
    """What ScatteredSums reads of a ShardedState: the sums it holds by range (its own and its buddy's)."""

    def __init__(self, own, buddy):
        self.reduced = {(0, own.numel()): own, (own.numel(), own.numel() + buddy.numel()): buddy}

    def own_range(self):
        return next(iter(self.reduced))


def test_scattered_ranges_agree_through_one_sum():
    """trainer.shard=gradients|parameters: each member judges its own ranges, and takes the squares of its own
    range's sums (not its buddy's copy) for the norm; one sum over the members decides for all."""
    calls = []

    def two_members(theirs):  # a stand-in for Replica.reduce_sum: adds another member's value
        def reduce_sum(values):
            calls.append(list(values))
            return [values[0] + theirs]
        return reduce_sum

    clean = Shards(torch.ones(3), torch.zeros(2))
    poisoned = Shards(torch.ones(3), torch.tensor([0.0, math.nan]))
    assert grad_check.ScatteredSums(clean, two_members(0.0)).grad_finite()
    assert not grad_check.ScatteredSums(clean, two_members(1.0)).grad_finite()  # the other member's range is NaN
    assert not grad_check.ScatteredSums(poisoned, two_members(0.0)).grad_finite()
    assert calls == [[0.0], [0.0], [1.0]]  # one collective each, on every member whatever it found
    engine = Engine(3.0, math.nan)  # the engine's own (unreduced) gradient is not read
    verdict = grad_check.check(engine, 0.5, None, None, grad_check.ScatteredSums(clean, two_members(0)))
    assert verdict.finite and engine.finite_checks == 0 and engine.norms == 0

    # Clipping: the norm is sqrt(own squares + the other member's), and both ranges are scaled by one factor.
    calls.clear()
    held = Shards(torch.full((3,), 2.0), torch.full((2,), 5.0))
    verdict = grad_check.check(engine, 0.5, 1.0, None, grad_check.ScatteredSums(held, two_members(13.0)))
    assert calls == [[pytest.approx(12.0)]]  # 3 x 2^2: the buddy's copy is another member's own range, counted there
    assert verdict.grad_norm == pytest.approx(5.0) and engine.norms == 0
    factor = 1.0 / (5.0 + 1e-6)
    assert torch.allclose(held.reduced[(0, 3)], torch.full((3,), 2.0 * factor))
    assert torch.allclose(held.reduced[(3, 5)], torch.full((2,), 5.0 * factor))


def test_the_norm_in_blocks_is_the_same_wherever_the_vector_is_cut():
    """_util/norms.py: the owners' pieces of a gradient give the whole one's sum of squares to ~1e-8, and both
    are within ~1e-6 of float64's (float32's own norm of a million elements is off by ~1e-5)."""
    from elasticflow._util.norms import sum_squares

    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    exact = float(x.double().square().sum())
    cuts = [0, 333_335, 666_669, 1_000_003]
    pieces = sum(sum_squares(x[a:b], a) for a, b in zip(cuts, cuts[1:]))
    assert abs(pieces - sum_squares(x)) / exact < 1e-7
    assert abs(sum_squares(x) - exact) / exact < 2e-6
    # precise (float16's loss scaling): float64 blocks, so the cut moves the sum by ~1e-16, not ~1e-9
    precise = sum(sum_squares(x[a:b], a, precise=True) for a, b in zip(cuts, cuts[1:]))
    assert abs(precise - sum_squares(x, 0, precise=True)) / exact < 1e-14
    assert abs(sum_squares(x, 0, precise=True) - exact) / exact < 1e-13


@pytest.mark.parametrize("name", ["torch", "tensorflow"])
def test_each_engine_finds_a_non_finite_element_of_its_gradient(name):
    from elasticflow import backends, ops, optim

    found = []
    with ops.using(name):
        module = backends.load(name)
        # d sqrt(a * x)/da = x / (2 sqrt(a * x)): inf at a * x = 0 with x > 0, NaN (0/0) with x = 0, finite
        # elsewhere; the loss, sqrt(0) = 0, is finite in every case.
        engine = module.Engine({"a": np.array([0.0, 1.0], np.float32)},
                               lambda x, params: ops.sum(ops.sqrt(params["a"] * x)), optim.SGD(0.1))
        for x in ([1.0, 1.0], [0.0, 1.0], [0.0, 0.0]):
            engine.zero_grad()
            loss, _ = engine.accumulate((module.to_tensor(np.array(x, np.float32)),), 1.0)
            found.append((float(loss), engine.grad_finite()))
        engine.load_state({"a": np.array([2.0, 1.0], np.float32)}, 0)
        engine.zero_grad()
        engine.accumulate((module.to_tensor(np.ones(2, np.float32)),), 1.0)
        found.append(engine.grad_finite())
    assert found == [(1.0, False), (1.0, False), (0.0, False), True]
