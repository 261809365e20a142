"""The layout of sharded optimizer state and the plans of a membership change: who owns which range of
the flat vector, which member sends which range to whom, and which members roll forward a step first.

Pure functions of the layout and of the table the members publish (``shard.ShardedState.table_row``), so
every member computes the same plan from the same table without another round of messages.

**The table**: one float64 row per member (exact for progress and offsets below 2**53):
``[progress, count, lo1, hi1, ... lo4, hi4, before, applied, lr, step, sends, sums]``: the committed
progress at which its held ranges are valid (-1: none valid), the ranges, then the step it applied last
while some member may not have (its kept step: the progress it started from, -1 for none; 1 if applied,
0 if skipped; the learning rate and the 1-based optimizer step it was applied with; 1 if it kept the
step's whole reduced gradient to send), and 1 if it holds the sums of the next step for all its ranges
(a parameter server's aggregator, which rolls forward with its own: ``replica/parameter_server.py``).

**Rolling forward.** A step is committed by each member on its own, once its reduction is complete; a
member that dies in the middle of the sum leaves some members with it (they commit step k) and some
without (they stay at k - 1). The members at k - 1 are one update behind, and the ranges only they still
hold (the dead member's slice, when its buddy is among them) would be lost. But a member at k keeps the
step's reduced gradient until the step's allgather completes (``ShardedState.keep_step``): it sends the
members behind the gradient of the ranges they hold, they apply the same update (same formula, same
reduced gradient, same lr and step: the same bits as the dead owner would have had), and every range is
held at k. The step is not redone, as in the replicated path (``Replica.sync_state``'s roll forward).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

MAX_HELD = 4   # ranges a member can hold at once: own and buddy, old and new during a handoff
KEPT = 2 + 2 * MAX_HELD   # the table's column where the kept step begins (before, applied, lr, step)
WIDTH = KEPT + 6
Range = Tuple[int, int]


def owned(n: int, world: int, rank: int) -> Range:
    """Rank ``rank``'s slice [lo, hi) of a flat vector of ``n`` elements over ``world`` members."""
    c = chunk(n, world)
    return min(rank * c, n), min((rank + 1) * c, n)


def chunk(n: int, world: int) -> int:
    return -(-n // world)


def needed(n: int, world: int, rank: int, replicas: int) -> List[Range]:
    """The ranges rank ``rank`` holds: its own, then its buddy's (the previous rank's) when replicated."""
    out = [owned(n, world, rank)]
    if replicas and world > 1:
        out.append(owned(n, world, (rank - 1) % world))
    return [r for r in out if r[1] > r[0]]


def covers(ranges: Sequence[Range], n: int) -> bool:
    """Whether ``ranges`` together cover [0, n)."""
    at = 0
    for lo, hi in sorted(ranges):
        if lo > at:
            return False
        at = max(at, hi)
    return at >= n


def held_row(at: int, ranges: Sequence[Range]) -> List[float]:
    """The head of a table row (the KEPT columns before the kept step): progress ``at``, then up to MAX_HELD of
    ``ranges`` (sorted), zero-padded."""
    held = sorted(ranges)[:MAX_HELD]
    row = [at, len(held)] + [x for r in held for x in r]
    return row + [0] * (KEPT - len(row))


def held_ranges(row: Sequence[float]) -> List[Range]:
    """The ranges a table row lists, in its order (``table_row`` sorts them)."""
    return [(int(row[2 + 2 * i]), int(row[3 + 2 * i])) for i in range(int(row[1]))]


@dataclass
class RangeMove:
    """Elements [lo, hi) that member ``src`` gives member ``dst`` (src == dst: already there)."""
    src: int
    dst: int
    lo: int
    hi: int


@dataclass
class Plan:
    target: int                          # the progress (samples seen) every range is taken at
    moves: List[RangeMove] = field(default_factory=list)
    lost: List[Range] = field(default_factory=list)   # ranges nobody holds at ``target``


@dataclass
class Roll:
    """Members one step behind (``takers``, at progress ``before``) that roll forward to ``target`` with the
    kept step of ``giver``: its reduced gradient (``applied``; a skipped step moves nothing), lr and step."""
    giver: int
    takers: List[int]
    before: int
    target: int
    applied: bool
    lr: float
    step: int
    sends: bool = True    # the giver sends its reduced gradient; False: each taker applies its own sums


def plan_roll(table: np.ndarray) -> Optional[Roll]:
    """Which members roll forward the step the most advanced ones kept, and from whom; None: nobody.

    A member behind whose held ranges overlap (never after a redistribution; a handoff's old and new
    ranges could) does not roll: its ranges share the parameters, and would take the update twice.
    """
    target = int(table[:, 0].max())
    givers = [m for m, row in enumerate(table) if int(row[0]) == target and len(row) > KEPT and row[KEPT] >= 0]
    if not givers:
        return None
    row = table[givers[0]]
    before = int(row[KEPT])
    applied, sends = bool(row[KEPT + 1]), bool(row[KEPT + 4])
    takers = [m for m, r in enumerate(table) if int(r[0]) == before < target and _disjoint(held_ranges(r))
              and (sends or not applied or r[KEPT + 5] > 0 or not held_ranges(r))]
    if not takers:
        return None
    return Roll(givers[0], takers, before, target, applied, float(row[KEPT + 2]), int(row[KEPT + 3]), sends)


def _disjoint(ranges: List[Range]) -> bool:
    ranges = sorted(ranges)
    return all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def plan_moves(table: np.ndarray, want: Dict[int, List[Range]]) -> Plan:
    """Which member sends which range to whom, the same on every member (it depends on ``table`` only).

    Args:
        table: one row per member (the layout above; only progress and ranges are read here).
        want: for each member, the ranges it must hold afterwards.
    """
    target = int(table[:, 0].max())
    holders = [(m, lo, hi) for m, row in enumerate(table) if int(row[0]) == target for lo, hi in held_ranges(row)]
    plan = Plan(target)
    for dst in sorted(want):
        for lo, hi in want[dst]:
            at = lo
            while at < hi:
                # Prefer the member itself (nothing moves), then the one reaching farthest, then the lowest rank.
                found = [(src != dst, -b, src, b) for src, a, b in holders if a <= at < b]
                if not found:
                    nxt = min([a for _, a, _ in holders if at < a < hi] + [hi])
                    plan.lost.append((at, nxt))
                    at = nxt
                    continue
                _, _, src, b = min(found)
                end = min(b, hi)
                plan.moves.append(RangeMove(src, dst, at, end))
                at = end
    merged: List[Range] = []
    for lo, hi in sorted(set(plan.lost)):  # wanted twice (an owner's and a buddy's): said once
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    plan.lost = merged
    return plan
