"""Stragglers (``elastic.straggler``; docs/elastic-training.md#stragglers): a member slower than its peers.

Every step each member measures its seconds per micro-batch (forward and backward of its share, with the wait for
its data) and the step's reduction sums the members' measurements into one vector that every member then holds
(a slot each, the others' zeros: the sum is the value, bit for bit). From those identical inputs every member
computes the same estimate (a median of the last few, so noise does not move shares every step) and so the same
decision, with no message of its own:

- ``rebalance`` (the default): the next steps deal the global batch's micro-batches by the estimate
  (``data.order.split_by_cost``): the same micro-batches in the same order, only who computes which changes, so
  the step's sum is the same (the same bits under trainer.reproducible, whose sums do not depend on who added
  what; to float32's rounding otherwise). Shares move only at a step boundary, only when the new ones would
  end the step clearly sooner (``GAIN``), and go back to equal whenever the members change.
- a member past ``elastic.straggler_factor`` x the median of the others' estimates for
  ``elastic.straggler_patience`` steps in a row is a straggler: rank 0 writes a ``straggler`` event (status and
  plot show it); under ``evict`` the straggler leaves at that step boundary (exit code
  ``protocol.EXIT_STRAGGLER``), the others regroup without it as after a crash, and the agent starts a
  replacement where ``launcher.restart_failed`` is set.

Shares are dealt by micro-batches only (``trainer.micro_batch_size``): without it a member's share is one
micro-batch of samples, and moving samples would change what a micro-batch is (a BatchNorm's statistics, an
in-batch loss). There the straggler is still reported, with a hint.
"""
from __future__ import annotations

import logging
import statistics
from typing import Any, List, Optional, Sequence

from ..data.order import split_by_cost, split_evenly

log = logging.getLogger("elasticflow")

WINDOW = 5        # the estimate: the median of a member's last this many measurements (a step held up once -- a
                  # page fault, a checkpoint, a test's hold -- moves nothing; a member slow for 3 steps does)
GAIN = 0.85       # new shares only when they would end the step in at most this fraction of the current ones' time


class Balance:
    """The members' speed estimates and the shares dealt by them, for one member (all hold the same).

    Args:
        elastic: the ``elastic`` config (straggler, straggler_factor, straggler_patience).
        micro_batch_size: trainer.micro_batch_size (None: shares are not moved). global_batch: its size.
        min_workers: launcher.min_workers (an eviction never takes the job below it).
    """

    def __init__(self, elastic: Any, micro_batch_size: Optional[int], global_batch: int, min_workers: int):
        self.mode, self.factor, self.patience = elastic.straggler, elastic.straggler_factor, elastic.straggler_patience
        self.units = -(-global_batch // micro_batch_size) if micro_batch_size else 0  # micro-batches a step
        self.min_workers = min_workers
        self.run_log: Any = None            # rank 0's RunLog, for the events (the stepper sets it)
        self.members: Any = None            # (generation, world) the estimates are of
        self.estimate: List[float] = []     # seconds per micro-batch, by rank: the median of ``recent``
        self.recent: List[List[float]] = []  # each rank's last WINDOW measurements
        self.costs: Optional[List[float]] = None  # the estimate the shares are dealt by (None: equal shares)
        self.measured = 0                   # steps measured since the members changed
        self.moved_at = 0                   # ``measured`` when the shares last moved
        self.slow_steps: List[int] = []     # steps in a row past the factor, by rank
        self.reported: set = set()          # ranks reported as stragglers: once per member while the members stay
        self.hinted = False

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def costs_for(self, generation: int, world: int) -> Optional[List[float]]:
        """The costs to deal this step's micro-batches by (``data.order.deal``), None for equal shares. The
        members changed: equal shares, and the measuring starts over (ranks are new)."""
        if (generation, world) != self.members:
            self.members, self.estimate, self.costs = (generation, world), [0.0] * world, None
            self.recent = [[] for _ in range(world)]
            self.measured, self.moved_at, self.slow_steps, self.reported = 0, 0, [0] * world, set()
        return self.costs

    def observe(self, seconds: Sequence[float], step: int, rank: int, workers: Sequence[Any]) -> Optional[int]:
        """The step's agreed measurements (seconds per micro-batch by rank; 0: none this step) after its commit;
        returns the rank to evict now (``evict``), else None. ``workers``: the worker id of each rank (events)."""
        if not self.on or len(seconds) != len(self.estimate) or len(seconds) < 2:
            return None
        self.measured += 1
        if self.measured == 1:
            return None  # a generation's first step pays for building what the next ones reuse
        for r, s in enumerate(seconds):
            if s > 0:  # 0: no micro-batch this step (the last, short batch of an epoch)
                self.recent[r] = (self.recent[r] + [float(s)])[-WINDOW:]
                self.estimate[r] = statistics.median(self.recent[r])
        if min(len(r) for r in self.recent) < WINDOW // 2 + 1:
            return None
        self._deal(step, rank)
        return self._stragglers(step, rank, workers)

    def _deal(self, step: int, rank: int) -> None:
        # Moved shares stay until a whole window was measured under them: a member's time per micro-batch may
        # depend on how many it computes (a fixed cost per step), and flapping would cost more than it saves
        if self.units < 2 or (self.moved_at and self.measured - self.moved_at < WINDOW):
            return
        est, units = self.estimate, self.units
        now = split_evenly(units, len(est)) if self.costs is None else split_by_cost(units, self.costs)
        new = split_by_cost(units, est)
        if new == now or max(n * e for n, e in zip(new, est)) > GAIN * max(n * e for n, e in zip(now, est)):
            return
        self.costs, self.moved_at = list(est), self.measured
        if rank == 0:
            log.info("shares by speed from step %d: %s micro-batches (%s ms each)", step + 1,
                     "+".join(map(str, new)), "/".join(f"{e * 1e3:.0f}" for e in est))
            self.run_log.event("rebalanced", step=step, shares=new, ms_per_micro_batch=[round(e * 1e3, 2) for e in est])

    def _stragglers(self, step: int, rank: int, workers: Sequence[Any]) -> Optional[int]:
        est, evict = self.estimate, None
        for r, e in enumerate(est):
            median = statistics.median(est[:r] + est[r + 1:])
            if e <= self.factor * median:
                self.slow_steps[r] = 0
                continue
            self.slow_steps[r] += 1
            if self.slow_steps[r] < self.patience or r in self.reported:
                continue
            self.reported.add(r)
            can_evict = self.mode == "evict" and evict is None and len(est) - 1 >= max(1, self.min_workers)
            action = "evict" if can_evict else ("rebalance" if self.units >= 2 else "report")  # observe: mode not off
            if rank == 0:
                worker = workers[r] if r < len(workers) else None
                hint = "" if self.hinted else \
                    " (set trainer.micro_batch_size so its share can shrink, or elastic.straggler=evict)"
                log.warning("straggler: worker %s (rank %d) took %.1fx the others' median time per micro-batch for "
                            "%d steps%s", worker, r, e / median, self.patience,
                            {"evict": ": evicted, the others go on without it",
                             "rebalance": ": it is dealt fewer micro-batches", "report": hint}[action])
                self.run_log.event("straggler", step=step, rank=r, worker=worker, slowdown=round(e / median, 2),
                                   ms_per_micro_batch=round(e * 1e3, 2), action=action)
                self.hinted = self.hinted or action == "report"
            if action == "evict":
                evict = r
        return evict
