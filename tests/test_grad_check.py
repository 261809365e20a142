"""grad_check: the summed gradient's unscale, overflow, non-finite and clipping verdict, on a stand-in engine."""
import math

import numpy as np
import torch

from elasticflow import grad_check


class Engine:
    """The two Engine calls grad_check makes, over one flat gradient; counts the norm's sync points."""

    def __init__(self, *values):
        self.grad = np.array(values, np.float64)
        self.norms = 0

    def grad_norm(self):
        self.norms += 1
        return float(np.linalg.norm(self.grad))

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
    assert plain.norms == bad_loss.norms == 0  # no sync point spent
    np.testing.assert_array_equal(bad_loss.grad, [3.0, 4.0])
