"""One step's exact sums under ``trainer.reproducible`` (docs/exactness.md): what each micro-batch adds, and the
reduction that reads them.

Each micro-batch adds its gradient, weighted loss and metrics and its BatchNorm contribution to the step's exact
sums (``replica/exact_sum.py``) as soon as it is computed, then leaves a clean slate for the next one: a zero
gradient and the buffers as the step began. So a micro-batch adds the same terms whichever worker computes it,
and the sums, exact, do not depend on who added what: the step is the same bits for any number of workers.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np


class ExactStep:
    """The exact sums of one step's attempt on this worker.

    Args:
        replica: the ``Replica`` (its ``exact_sum`` lays the sums out, its ``start_exact`` reduces them).
        engine: the backend Engine. metric_names: forward()'s metrics, in the order they are reduced.
        params: how many parameters (each sends a flag: whether a micro-batch's backward reached it).
        reconciler: the buffers' ``Reconciler`` (begun for this step), or None. slots: how many values the members'
        slots hold (``Stepper._slots``: each member's speed and its parameters' fingerprint).
    """

    def __init__(self, replica: Any, engine: Any, metric_names: List[str], params: int, reconciler: Any,
                 slots: int):
        self.replica, self.engine, self.metric_names, self.reconciler = replica, engine, metric_names, reconciler
        self.scalars = 1 + len(metric_names)  # the loss, then the metrics
        self.head = replica.exact_head()  # the gradient's sums (none with stage 3: its owners took them in backward)
        self.slots = slots
        self.sums = replica.exact_sum(self.scalars + params + slots, reconciler.size if reconciler else 0)
        self.took = np.zeros(params, bool)  # a parameter some micro-batch's backward reached (zero_grad clears it)
        self.rows: List[List[float]] = []    # each micro-batch's loss and metrics ...
        self.parts: List[np.ndarray] = []    # ... and buffer contribution: added in one call each, at start()

    def add(self, loss: Any, metrics: Dict[str, Any], index: int, total: int) -> None:
        """Micro-batch ``index`` (of the global batch's ``total``), just computed: its terms into the sums."""
        engine, sums = self.engine, self.sums
        self.took |= engine.took_part()
        if self.head:  # four micro-batches' gradients at a time (add_later: the same bits, a quarter of the passes)
            sums.add_later(engine.grad_view())
        engine.zero_grad()
        self.rows.append([float(loss)] + [float(metrics.get(k, 0.0)) for k in self.metric_names])  # a sync point
        rec = self.reconciler
        if rec is not None:  # from the step's buffers, one micro-batch: "mean" and "first" over the micro-batches
            self.parts.append(rec.contribution(engine.buffer_arrays(), index, 1, total, index, total))
            engine.set_buffers(rec.start_values())

    def start(self, interrupt: bool, slots: np.ndarray) -> Any:
        """The step's reduction (``Replica.start_exact``): the scalars, the parameters' flags and the members'
        ``slots``, as ``Replica.start_reduce`` returns them."""
        sums, head = self.sums, self.head
        sums.flush()
        sums.add_rows(np.asarray(self.rows, np.float64).reshape(-1, self.scalars), at=head)
        sums.add(self.took.astype(float), at=head + self.scalars)
        sums.add(np.asarray(slots, np.float64), at=head + self.scalars + len(self.took))
        if self.parts:
            sums.add_rows(np.stack(self.parts), at=sums.n - self.reconciler.size)
        return self.replica.start_exact(self.sums, self.scalars + len(self.took) + self.slots, interrupt,
                                        self.reconciler is not None)
