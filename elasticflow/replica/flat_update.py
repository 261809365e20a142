"""The optimizer's update over one range of the flat parameter vector, and the step a member keeps until its
allgather completes: what a holder of sharded state (``shard.ShardedState``, a parameter server's
aggregator) applies, the same float32 operations a 1-worker run applies to the whole vector."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..backends.torch.optim import adam_update, sgd_update, weight_decay_is_l2
from ..config.optim import Adam, AdamW, OptimizerSpec, Stretch, stretches


@dataclass
class KeptStep:
    """The step a member applied last, kept until its allgather completes (until then some member may
    not have applied it, and rolls forward with it: ``shard_plan``'s note)."""
    before: int                     # the progress the step started from ...
    at: int                         # ... and the one it committed
    lr: float
    step: int                       # the optimizer step (1-based); Adam's bias correction
    grad: Optional[torch.Tensor]    # the reduced gradient (stage 1's whole vector); None: skipped, or stage 2
    applied: bool = True            # False: the step was skipped (a non-finite gradient): nothing to apply
    kept: bool = False              # a recovery kept it: grad is this object's copy (``keep_step``)
    took_part: Optional[np.ndarray] = None  # per parameter: had a gradient (None: all had); ``optim.stretches``
    sat_out: Optional[np.ndarray] = None    # per parameter: steps it sat out before this one (None: none)

    def participation(self, n: int) -> torch.Tensor:
        """``took_part`` and ``sat_out`` of ``n`` parameters as one float64 tensor of 2n values (what a member
        behind needs beside the gradient to apply this step as it was applied: ``participation_of``)."""
        took = np.ones(n) if self.took_part is None else self.took_part
        sat = np.zeros(n) if self.sat_out is None else self.sat_out
        return torch.from_numpy(np.concatenate([took, sat]).astype(np.float64))


def participation_of(values: torch.Tensor) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """``KeptStep.participation``'s tensor as (took_part, sat_out), each None where it says nothing."""
    n = values.numel() // 2
    took, sat = values[:n].numpy() > 0, values[n:].numpy().astype(np.int64)
    return (None if took.all() else took), (sat if sat.any() else None)


class FlatUpdate:
    """The optimizer's formula over one range of the flat vector: torch.optim's SGD, or the flat Adam's.

    Elementwise, so a range updated alone gets the values the whole vector would (see the design above).
    ``runs``: the engine's ``flat_runs()``, each parameter group's stretch and hyperparameters; a range
    that crosses groups is updated stretch by stretch.
    """

    def __init__(self, spec: OptimizerSpec, runs: Sequence[Tuple[int, int, Any]], sizes: Sequence[int],
                 exact_sqrt: bool = False):
        self.spec = spec
        self.exact_sqrt = exact_sqrt  # Adam's root as the engine takes it (the TensorFlow engine: correctly rounded)
        self.runs = list(runs)
        self.sizes = list(sizes)  # each parameter's elements, in the flat order
        self.slots = spec.slots()
        self.adam = isinstance(spec, Adam)
        self.decoupled = isinstance(spec, AdamW)
        self.l2 = self.adam and weight_decay_is_l2(spec, self.runs)

    def plan(self, step: int, took_part: Optional[np.ndarray] = None,
             sat_out: Optional[np.ndarray] = None) -> List[Stretch]:
        """The stretches of optimizer step ``step`` (1-based) and the step each takes (``optim.stretches``:
        parameters with no gradient sit it out)."""
        return stretches(self.runs, self.sizes, step, took_part, sat_out)

    @torch.no_grad()
    def __call__(self, lo: int, param: torch.Tensor, grad: torch.Tensor, slots: Dict[str, torch.Tensor],
                 lr: float, plan: Sequence[Stretch], scratch: torch.Tensor) -> None:
        """Update ``param`` (the flat vector's elements from ``lo`` on) and its ``slots`` in place, where
        ``plan`` (``plan()``) says."""
        hi = lo + param.numel()
        for a, b, h, step in plan:
            a, b = max(a, lo), min(b, hi)
            if a < b:
                self._stretch(param[a - lo:b - lo], grad[a - lo:b - lo],
                              {k: v[a - lo:b - lo] for k, v in slots.items()}, lr * h.lr_scale, h.weight_decay,
                              step, scratch)

    def _stretch(self, param, grad, slots, lr: float, weight_decay: float, step: int, scratch) -> None:
        s = self.spec
        if self.adam:
            k = param.numel()  # scratch: the denominator, then Adam's L2 term (grad + wd * param)
            adam_update(param, grad, slots["exp_avg"], slots["exp_avg_sq"], scratch[:k], lr, s.betas, s.eps,
                        weight_decay, self.decoupled, step, l2_out=scratch[k:2 * k] if self.l2 else None,
                        exact_sqrt=self.exact_sqrt)
            return
        # torch.optim.SGD's step, as the engine's. The buffer starts at zero instead of taking the first
        # gradient (first=False): 0 * m + g == g, but for the sign of a zero.
        sgd_update(param, grad, slots.get("momentum_buffer"), lr, s.momentum, s.nesterov, weight_decay,
                   first=False)
