"""Buffers (BatchNorm's running statistics and the like) made identical on every replica, and equal to what
one worker computes over the same micro-batches in order.

Each worker runs its micro-batches ``[a, b)`` of the ``K`` a global batch is cut into, from the same
buffers ``r0``, and so holds its own ``r_w``. A rule per buffer says how the members' buffers combine;
each member sends a contribution, one allreduce sums them, and ``finish`` turns the sum into the
buffer one worker would hold. The rules (``Rule.kind``):

- ``ema``: ``r <- (1 - m) r + m s`` at every micro-batch (torch BatchNorm with ``momentum=m``; Keras'
  BatchNormalization with ``momentum = 1 - m``). Linear in the batch statistics ``s``, so with
  ``q = 1 - m``: ``r_K = q^K r0 + sum_w q^(K - b_w) (r_w - q^(b_w - a_w) r0)``.
- ``cma``: the cumulative average of torch BatchNorm with ``momentum=None`` (weight 1/n, n its
  ``num_batches_tracked`` after the increment): ``n_K r_K = n_0 r0 + sum_w (n_w r_w - n_0 r0)``.
- ``count``: a counter (``num_batches_tracked``): ``r0 + sum_w (r_w - r0)``.
- ``mean``: any other floating buffer: ``r0`` plus the mean of the members' changes (an unchanged
  buffer stays bit-identical).
- ``first``: any other integer buffer: rank 0's.

Note: a BatchNorm layer called more than once per micro-batch (a shared layer) updates more often than
the ``ema`` rule assumes; its statistics are then coherent across replicas but not those of one worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class Rule:
    kind: str                       # ema | cma | count | mean | first
    momentum: float = 0.0           # ema: the weight m of the new batch statistic
    counter: Optional[str] = None   # cma: the buffer that counts the updates


def default_rule(array: np.ndarray) -> Rule:
    return Rule("mean") if np.issubdtype(array.dtype, np.floating) else Rule("first")


class Reconciler:
    """Snapshots the buffers at a step's start and reconciles them after its micro-batches.

    Works on one flat float64 vector of every buffer, with the rules turned into per-element coefficients
    once: a step then costs a few vector operations whatever the number of buffers (a loop over a ResNet's
    hundreds of BatchNorm buffers would cost a millisecond a step).

    Args:
        rules: a rule for every buffer to reconcile, by name.

    Example (each member, every step):
        >>> rec.begin(engine_buffers)                                  # before the first micro-batch
        >>> part = rec.contribution(engine_buffers, first=a, count=b - a, total=K, rank=r, world=W)
        >>> new = rec.finish(allreduce_sum(part))                       # the same on every member
    """

    def __init__(self, rules: Dict[str, Rule]):
        self.rules = rules
        self.names: List[str] = list(rules)
        self._flat0: Optional[np.ndarray] = None  # the step's starting values, flat (None before begin)
        self._total = 0
        self._layout: Optional[Tuple[List[int], List[tuple], List[np.dtype]]] = None

    @property
    def size(self) -> int:
        """Elements of every buffer together (after ``begin``): the length of a contribution."""
        return 0 if self._flat0 is None else self._flat0.size

    @property
    def has_batch_statistics(self) -> bool:
        """Whether some buffer is a running statistic of batches (BatchNorm's)."""
        return any(rule.kind in ("ema", "cma") for rule in self.rules.values())

    def _flatten(self, buffers: Dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.ravel(buffers[n]) for n in self.names]).astype(np.float64)

    def _prepare(self, buffers: Dict[str, np.ndarray]) -> None:
        """Per-element coefficients of the rules, from the first buffers seen (their sizes are fixed)."""
        sizes = [np.size(buffers[n]) for n in self.names]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self._layout = (offsets.tolist(), [np.shape(buffers[n]) for n in self.names],
                        [np.asarray(buffers[n]).dtype for n in self.names])
        n = int(offsets[-1])
        self._q = np.ones(n)                      # ema: 1 - momentum
        self._ema = np.zeros(n, bool)
        self._cma = np.zeros(n, bool)
        self._counter_at = np.zeros(n, int)       # cma: where each element's counter sits
        self._first = np.zeros(n, bool)
        self._scale = np.ones(n)                  # mean: 1 / world, applied in contribution
        self._mean = np.zeros(n, bool)
        for i, name in enumerate(self.names):
            lo, hi, rule = offsets[i], offsets[i + 1], self.rules[name]
            if rule.kind == "ema":
                self._ema[lo:hi], self._q[lo:hi] = True, 1.0 - rule.momentum
            elif rule.kind == "cma":
                self._cma[lo:hi] = True
                self._counter_at[lo:hi] = offsets[self.names.index(rule.counter)]
            elif rule.kind == "mean":
                self._mean[lo:hi] = True
            elif rule.kind == "first":
                self._first[lo:hi] = True

    def begin(self, buffers: Dict[str, np.ndarray], total: int = 0) -> None:
        """Remember the buffers as the step starts (a copy: the step's forwards change them in place); ``total``:
        the step's micro-batches, for ``finish`` (``contribution`` also sets it)."""
        if self._layout is None:
            self._prepare(buffers)
        self._flat0 = self._flatten(buffers)
        self._total = total

    def start_values(self) -> Optional[Dict[str, np.ndarray]]:
        """The buffers as the step started (to put back when a step fails); None before any step."""
        return None if self._flat0 is None else self._unflatten(self._flat0)

    def contribution(self, buffers: Dict[str, np.ndarray], first: int, count: int, total: int, rank: int,
                     world: int) -> np.ndarray:
        """This member's share of the sum (float64, one flat vector) after its micro-batches
        ``first .. first + count`` of ``total``."""
        self._total = total
        r0, rw = self._flat0, self._flatten(buffers)
        part = rw - r0                                                   # count; mean and first below
        ema = self._ema
        if ema.any():
            q = self._q[ema]
            part[ema] = q ** (total - first - count) * (rw[ema] - q ** count * r0[ema])
        cma = self._cma
        if cma.any():
            at = self._counter_at[cma]
            part[cma] = rw[at] * rw[cma] - r0[at] * r0[cma]
        part[self._mean] /= world
        if rank != 0:
            part[self._first] = 0.0
        return part

    def finish(self, summed: np.ndarray) -> Dict[str, np.ndarray]:
        """The buffers one worker would hold, from the members' summed contributions, in their own dtypes."""
        r0 = self._flat0
        new = r0 + summed
        ema = self._ema
        if ema.any():
            new[ema] = self._q[ema] ** self._total * r0[ema] + summed[ema]
        cma = self._cma
        if cma.any():  # divides by the counter's new value, which the count rule just gave
            at = self._counter_at[cma]
            n0, nk = r0[at], new[at]
            safe = np.where(nk > 0, nk, 1.0)
            new[cma] = np.where(nk > 0, (n0 * r0[cma] + summed[cma]) / safe, r0[cma])
        return self._unflatten(new)

    def _unflatten(self, flat: np.ndarray) -> Dict[str, np.ndarray]:
        offsets, shapes, dtypes = self._layout
        return {name: flat[offsets[i]:offsets[i + 1]].reshape(shapes[i]).astype(dtypes[i])
                for i, name in enumerate(self.names)}
