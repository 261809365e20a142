"""float16's dynamic loss scale: torch.amp.GradScaler's rule, kept in the replicated TrainState.

The loss is multiplied by the scale before backward so that small gradients survive float16's narrow
range; the summed gradient is divided by it before the update. A step whose summed gradient is not
finite overflowed: it is skipped and the scale halves; after ``GROWTH_INTERVAL`` good steps in a row the
scale doubles. Every member checks the same summed gradient (one overflow anywhere makes the sum
non-finite everywhere), so every member skips the same steps and holds the same scale, with no vote.
"""
from __future__ import annotations

from typing import Tuple

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
