"""The summed gradient's checks before an update: float16's unscale and overflow, non-finite values, clipping.

Every member runs them on the same summed gradient, so every member reaches the same verdict without a
vote (as ``loss_scale`` relies on).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional


class Verdict(NamedTuple):
    grad_norm: Optional[float]  # unscaled, before clipping; None when neither clipping nor loss scaling needs it
    overflow: bool              # float16 overflowed: skip the update and lower the scale (loss_scale.next_scale)
    finite: bool                # loss and gradient are finite: the update may run

    def problem(self, loss: float) -> str:
        """What is not finite, for the message of a step that cannot be applied."""
        return f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {self.grad_norm}"


def check(engine: Any, loss: float, grad_clip: Optional[float], scale: Optional[float]) -> Verdict:
    """Unscale the engine's summed gradient (``scale``: float16's loss scale; None without loss scaling)
    and clip it to ``grad_clip`` (torch.nn.utils.clip_grad_norm_'s formula), in place.

    Note: the norm is a sync point on accelerators; it is computed only when clipping or scaling asks.
    """
    if not math.isfinite(loss) or (grad_clip is None and scale is None):
        return Verdict(None, False, math.isfinite(loss))
    grad_norm = engine.grad_norm()
    overflow = False
    if scale is not None:
        overflow = not math.isfinite(grad_norm)
        engine.scale_grad(1.0 / scale)
        grad_norm /= scale
    finite = math.isfinite(grad_norm)
    if finite and grad_clip is not None and grad_norm > grad_clip:
        engine.scale_grad(grad_clip / (grad_norm + 1e-6))
    return Verdict(grad_norm, overflow, finite)


class Update(NamedTuple):
    """What a step does with its summed gradient: ``apply`` it, ``skip`` it, or ``stop`` the run."""
    action: str                 # apply | skip | stop
    why: Optional[str] = None   # skip/stop: what was wrong (float16 overflow, a non-finite loss or gradient)


def decide(verdict: Verdict, loss: float, on_nonfinite: str) -> Update:
    """The update's fate: float16's overflow skips it (as torch's GradScaler does, lowering the scale);
    a non-finite loss or gradient skips it or stops the run, as ``trainer.on_nonfinite`` says."""
    if verdict.overflow:
        return Update("skip", "overflow")
    if not verdict.finite:
        return Update("stop" if on_nonfinite == "stop" else "skip", verdict.problem(loss))
    return Update("apply")
