"""The summed gradient's checks before an update: float16's unscale and overflow, non-finite values, clipping.

Every member runs them on the same summed gradient, so every member reaches the same verdict without a
vote (as ``loss_scale`` relies on).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

from ..errors import ElasticFlowError
from ..replica.exact_sum import sum_squares_reproducibly


class Verdict(NamedTuple):
    grad_norm: Optional[float]  # unscaled, before clipping; None when neither clipping nor loss scaling needs it
    overflow: bool              # float16 overflowed: skip the update and lower the scale (loss_scale.next_scale)
    finite: bool                # loss and gradient are finite: the update may run

    def problem(self, loss: float) -> str:
        """What is not finite, for the message of a step that cannot be applied."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if self.grad_norm is None:  # no norm was taken: grad_finite() said it
            return f"the summed gradient has NaN or inf values (the loss, {loss:.6g}, is finite)"
        return f"gradient norm is {self.grad_norm}"


def check(engine: Any, loss: float, grad_clip: Optional[float], scale: Optional[float],
          summed: Any = None) -> Verdict:
    """Unscale the engine's summed gradient (``scale``: float16's loss scale; None without loss scaling)
    and clip it to ``grad_clip`` (torch.nn.utils.clip_grad_norm_'s formula), in place; and check that it
    is finite, on every step: a NaN gradient with a finite loss (sqrt or log at 0 in forward()) would
    otherwise be applied, and train and checkpoint NaN weights.

    ``summed``: the summed gradient where each member holds the sums of its own ranges only
    (``ScatteredSums``: trainer.shard=gradients|parameters), the engine's with a norm that does not depend on
    the cut (``WholeNorm``: trainer.reproducible, float16); None: the engine's.

    Note: the check reuses the norm where clipping or scaling takes one; otherwise it costs one read of
    the gradient (its sum: ``Engine.grad_finite``): a fraction of a millisecond for a few million parameters
    on one CPU core, a few thousandths of such a model's step, below the step's own noise
    (scripts/bench/bench_nonfinite.py); on accelerators it is one more sync point before the update.
    """
    if not math.isfinite(loss):
        return Verdict(None, False, False)
    summed = summed or engine
    if grad_clip is None and scale is None:
        return Verdict(None, False, summed.grad_finite())
    grad_norm = summed.grad_norm()
    overflow = False
    if scale is not None:
        overflow = not math.isfinite(grad_norm)
        summed.scale_grad(1.0 / scale)
        grad_norm /= scale
    finite = math.isfinite(grad_norm)
    if finite and grad_clip is not None and grad_norm > grad_clip:
        summed.scale_grad(grad_clip / (grad_norm + 1e-6))
    return Verdict(grad_norm, overflow, finite)


def per_weight(total: float, step: int) -> float:
    """The factor that turns sums weighted by forward()'s ``weight`` into the global batch's weighted mean
    (1 where the batch weighs nothing: its weighted sums are zero already). A negative total is refused: a
    weight counts (target tokens), and dividing by a negative sum would reverse the update."""
    if total < 0:
        raise ElasticFlowError(f"forward()'s weights sum to {total:g} over the global batch of step {step}",
                               "return a weight >= 0 (the number of target tokens, e.g. (labels != -100).sum())")
    return 1.0 / total if total > 0 else 1.0


def weight_unlike_probe(weighted: bool) -> ElasticFlowError:
    """forward() returned a ``weight`` in training but not in the start-up probe (evaluation mode), or the
    other way round: the members reduce the metrics the probe found, so the weight would be lost."""
    has, lacks = ("the start-up probe", "a training micro-batch") if weighted else \
        ("a training micro-batch", "the start-up probe")
    return ElasticFlowError(f"forward() returned a 'weight' in {has} but not in {lacks} (evaluation mode runs "
                            "the probe)", "return the weight in training and evaluation alike, or never")


class ScatteredSums:
    """The summed gradient where each member holds the sums of its own ranges only (trainer.shard=gradients and
    parameters, parameter servers: ``shards.reduced``, its own range and its buddy's), with the engine's three
    gradient calls made of it. Each answer is one small collective (``reduce_sum``) every member makes at the same point, so every
    member reaches the same verdict and the same clipping factor.

    Note: the extra collective is one small round trip a step; it cannot ride in the step's reduction, which is
    what produces the sums it judges.
    """

    def __init__(self, shards: Any, reduce_sum: Callable[[list], list],
                 allreduce_exact: Optional[Callable[[Any], Any]] = None, precise: bool = False):
        self.shards, self.reduce_sum = shards, reduce_sum
        self.allreduce_exact = allreduce_exact  # trainer.reproducible: the squares' sum exact (Replica.allreduce_exact)
        self.precise = precise  # float16's loss scaling: blocks in float64 (norms.sum_squares)

    def grad_finite(self) -> bool:
        bad = sum(0.0 if math.isfinite(float(r.sum())) else 1.0 for r in self.shards.reduced.values())
        return self.reduce_sum([bad])[0] == 0.0

    def grad_norm(self) -> float:
        """The whole gradient's 2-norm: each member's own range once (not its buddy's copy), squares added
        over the members in float64."""
        from .._util.norms import sum_squares  # torch's: the shards' sums are torch tensors on either backend

        lo, hi = self.shards.own_range()
        if self.allreduce_exact is not None:  # exact, then rounded once to float64: the same at any cut and scale
            squares = sum_squares_reproducibly(self.shards.reduced[(lo, hi)])
            return math.sqrt(float(self.allreduce_exact(squares).values()[0]))
        return math.sqrt(self.reduce_sum([sum_squares(self.shards.reduced[(lo, hi)], lo, self.precise)])[0])

    def scale_grad(self, factor: float) -> None:
        for summed in self.shards.reduced.values():
            summed.mul_(factor)


class WholeNorm:
    """The engine's whole summed gradient with the norm ``ScatteredSums`` takes of it cut among owners
    (trainer.shard=gradients|parameters), where the engine's own norm rounds by its float32 blocks: summed
    exactly and rounded once (``exact``: trainer.reproducible, the same bits), else with float64 blocks (float16's
    loss scaling)."""

    def __init__(self, engine: Any, exact: bool):
        self.engine, self.exact = engine, exact

    def grad_finite(self) -> bool:
        return self.engine.grad_finite()

    def grad_norm(self) -> float:
        import torch

        from .._util.norms import sum_squares

        grad = torch.as_tensor(self.engine.grad_view())
        if self.exact:
            return math.sqrt(float(sum_squares_reproducibly(grad).values()[0]))
        return math.sqrt(sum_squares(grad, 0, precise=True))

    def scale_grad(self, factor: float) -> None:
        self.engine.scale_grad(factor)


class Update(NamedTuple):
    """What a step does with its summed gradient: ``apply`` it, ``skip`` it, or ``stop`` the run."""
    action: str                 # apply | skip | stop
    why: Optional[str] = None   # skip/stop: what was wrong (float16 overflow, a non-finite loss or gradient)
    hint: Optional[str] = None  # stop: how to fix it


# A diverging loss wants a smaller step; a NaN gradient under a finite loss comes from an op whose derivative
# is not finite where it ran, which no learning rate or clipping cures (clipping a NaN norm gives NaN).
DIVERGED = "lower optimizer.lr, set trainer.grad_clip, or pass trainer.on_nonfinite=skip to skip such steps"
BAD_DERIVATIVE = ("look in forward() for an op whose derivative is not finite where it ran (sqrt or log at 0, "
                  "a division by 0), or pass trainer.on_nonfinite=skip to skip such steps")


def decide(verdict: Verdict, loss: float, on_nonfinite: str) -> Update:
    """The update's fate: float16's overflow skips it (as torch's GradScaler does, lowering the scale);
    a non-finite loss or gradient skips it or stops the run, as ``trainer.on_nonfinite`` says."""
    if verdict.overflow:
        return Update("skip", "overflow")
    if not verdict.finite:
        hint = DIVERGED if not math.isfinite(loss) or verdict.grad_norm is not None else BAD_DERIVATIVE
        return Update("stop" if on_nonfinite == "stop" else "skip", verdict.problem(loss), hint)
    return Update("apply")
