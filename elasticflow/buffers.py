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
from typing import Dict, List, Optional

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
        self.r0: Dict[str, np.ndarray] = {}
        self._sizes: List[int] = []
        self._total = 0

    @property
    def has_batch_statistics(self) -> bool:
        """Whether some buffer is a running statistic of batches (BatchNorm's)."""
        return any(rule.kind in ("ema", "cma") for rule in self.rules.values())

    def begin(self, buffers: Dict[str, np.ndarray]) -> None:
        """Remember the buffers as the step starts (a copy: the step's forwards change them in place)."""
        self.r0 = {n: np.array(buffers[n], copy=True) for n in self.names}
        self._sizes = [self.r0[n].size for n in self.names]

    def contribution(self, buffers: Dict[str, np.ndarray], first: int, count: int, total: int, rank: int,
                     world: int) -> np.ndarray:
        """This member's share of the sum (float64, one flat vector) after its micro-batches
        ``first .. first + count`` of ``total``."""
        self._total = total
        parts = []
        for name in self.names:
            rule, r0 = self.rules[name], self.r0[name].astype(np.float64)
            rw = np.asarray(buffers[name], dtype=np.float64)
            if rule.kind == "ema":
                q = 1.0 - rule.momentum
                part = q ** (total - first - count) * (rw - q ** count * r0)
            elif rule.kind == "cma":
                n0, nw = float(self.r0[rule.counter]), float(buffers[rule.counter])
                part = nw * rw - n0 * r0
            elif rule.kind in ("count", "mean"):
                part = (rw - r0) / (world if rule.kind == "mean" else 1)
            else:  # first
                part = (rw - r0) if rank == 0 else np.zeros_like(r0)
            parts.append(part.reshape(-1))
        return np.concatenate(parts) if parts else np.zeros(0)

    def finish(self, summed: np.ndarray) -> Dict[str, np.ndarray]:
        """The buffers one worker would hold, from the members' summed contributions."""
        offsets = np.cumsum([0] + self._sizes)
        pieces = {n: summed[offsets[i]:offsets[i + 1]].reshape(self.r0[n].shape) for i, n in enumerate(self.names)}
        out: Dict[str, np.ndarray] = {}
        for name in self.names:  # counters first: a cumulative average divides by its counter's new value
            if self.rules[name].kind != "cma":
                out[name] = self._combine(name, pieces[name])
        for name in self.names:
            if self.rules[name].kind == "cma":
                rule = self.rules[name]
                n0, nk = float(self.r0[rule.counter]), float(out[rule.counter])
                out[name] = ((n0 * self.r0[name] + pieces[name]) / nk if nk else self.r0[name])
        return {n: np.asarray(v).astype(self.r0[n].dtype) for n, v in out.items()}

    def _combine(self, name: str, piece: np.ndarray) -> np.ndarray:
        rule, r0 = self.rules[name], self.r0[name].astype(np.float64)
        if rule.kind == "ema":
            return (1.0 - rule.momentum) ** self._total * r0 + piece
        return r0 + piece
