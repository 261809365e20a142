"""float16's dynamic loss scale: torch.amp.GradScaler's rule, kept in the replicated TrainState.

The loss is multiplied by the scale before backward so that small gradients survive float16's narrow
range; the summed gradient is divided by it before the update. A step whose summed gradient is not
finite overflowed: it is skipped and the scale halves; after ``GROWTH_INTERVAL`` good steps in a row the
scale doubles. Every member checks the same summed gradient (one overflow anywhere makes the sum
non-finite everywhere), so every member skips the same steps and holds the same scale, with no vote.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

INIT = 2.0 ** 16          # GradScaler's init_scale
GROWTH = 2.0              # powers of two: scaling and unscaling are exact
BACKOFF = 0.5
GROWTH_INTERVAL = 2000    # good steps before the scale doubles


def next_scale(scale: float, good_steps: int, overflow: bool) -> Tuple[float, int]:
    """(scale, good steps in a row) after a step that did or did not overflow."""
    if overflow:
        return scale * BACKOFF, 0
    good_steps += 1
    if good_steps >= GROWTH_INTERVAL:
        return scale * GROWTH, 0
    return scale, good_steps


def weight_scale(per_sample: Optional[float], global_batch: int) -> float:
    """A power of two near 1 / (a global batch's weight), from the start-up probe's weight per sample.

    forward()'s ``weight`` (target tokens) multiplies a micro-batch's loss before backward, so the gradient
    that float16 carries is hundreds of times larger than with a share of the batch (<= 1): the first steps
    overflowed and were skipped while the loss scale halved down to it. Backward runs on the loss times this
    factor as well and the summed gradient is divided by it after the reduction: a power of two, both are
    exact, so the update is the one without it. Every member derives it from the same probe."""
    if not per_sample or per_sample <= 0 or not math.isfinite(per_sample):
        return 1.0
    return 2.0 ** -round(math.log2(per_sample * global_batch))
