"""A device that computes wrongly (``elastic.verify_every=N`` under ``trainer.reproducible``;
docs/elastic-training.md#silent-corruption): one micro-batch computed by two members and compared bit for bit.

Fingerprints (fingerprint.py) compare what the members hold. A device whose arithmetic is wrong but whose memory
is sound would give every replica the same wrong update, and no fingerprint would differ. Under
``trainer.reproducible`` a micro-batch's gradient is the same bits on any worker (a fixed thread count,
deterministic kernels: docs/exactness.md), so every N steps one micro-batch (a different one each time) is
computed again by the rank after the one dealt it, and both add a checksum of its gradient and loss to their slots
of the step's sums. Then:

- equal: nothing happens. The cost is one micro-batch on one member every N steps;
- different: nothing of the step is applied; a ``corruption`` event (``action: referee``) and the step is redone
  with every member computing that micro-batch. In the redo a strict majority's odd members leave (exit code
  ``protocol.EXIT_MISCOMPUTE``, ``evicted: its computation differed``) and the others redo the step without them;
  with no majority (2 members, or no two agree) the job stops with an error naming the workers: the state is
  sound, a device is not, so no checkpoint would help. A redo in which all agree goes on (a transient fault).
"""
from __future__ import annotations

import logging
import struct
from typing import Any, List, Optional, Sequence

from ..data import order as data
from ..distributed import protocol
from ..errors import ElasticFlowError
from . import fingerprint

log = logging.getLogger("elasticflow")


class Spot:
    """This step's spot check: the global micro-batch ``index``, its ``owner`` (the rank dealt it) and the
    ``ranks`` that compute it (the owner and the next rank, or every member in a referee's redo)."""

    def __init__(self, index: int, owner: int, ranks: List[int], referee: bool):
        self.index, self.owner, self.ranks, self.referee = index, owner, ranks, referee


class SpotCheck:
    """``elastic.verify_every``: which micro-batch a step checks, its checksums, and what a difference does.

    Args:
        every: N (None or 0: never).
    """

    def __init__(self, every: Optional[int]):
        self.every = int(every or 0)
        self.referee_step: Optional[int] = None  # the step whose redo every member computes the micro-batch of
        self.value = 0                            # this member's checksum of the spot's micro-batch, 0: none

    def plan(self, step: int, span: Any, world: int, micro: Optional[int], costs: Any) -> Optional[Spot]:
        """The spot check of optimizer step ``step + 1`` (``span``: the global batch's (start, end)), or None."""
        self.value = 0
        referee = self.referee_step == step
        if not self.every or world < 2 or not (referee or (step + 1) % self.every == 0):
            return None
        shares = [data.deal(span, r, world, micro, costs) for r in range(world)]
        total = shares[0].total
        index = (step + 1) // self.every % total if total else 0
        owner = next((r for r, sh in enumerate(shares) if sh.first <= index < sh.first + len(sh.micro)), None)
        if owner is None:
            return None
        return Spot(index, owner, list(range(world)) if referee else [owner, (owner + 1) % world], referee)

    def observe(self, grad: Any, loss: Any) -> None:
        """The spot's micro-batch just computed here (its gradient alone in ``grad``): its checksum, kept."""
        bits = struct.unpack("<q", struct.pack("<d", float(loss)))[0] % fingerprint.PRIME
        self.value = (fingerprint.checksum(grad) + bits) % fingerprint.PRIME + 1

    def recompute(self, engine: Any, spot: Spot, rows: Any, weight: float, seed: int, reconciler: Any) -> None:
        """Compute the spot's micro-batch here too (not this member's: nothing of it enters the step's sums)."""
        engine.seed(seed)
        loss, _ = engine.accumulate(rows, weight)
        self.observe(engine.grad_view(), loss)
        engine.zero_grad()  # its gradient and flags out of this member's step
        if reconciler is not None:
            engine.set_buffers(reconciler.start_values())

    def slots(self) -> Sequence[float]:
        """This member's two numbers of the step's sums (``fingerprint.halves``; 0, 0: it computed no spot)."""
        return fingerprint.halves(self.value) if self.value else (0, 0)

    def check(self, spot: Spot, reported: Sequence[float], rank: int, step: int, workers: Sequence[int],
              run_log: Any) -> None:
        """Act on every member's ``reported`` numbers (two each): nothing where those who computed agree, else
        raises (the step is redone with a referee, or without the odd members, or the job stops)."""
        got = {r: v for r, v in enumerate(fingerprint.joined(reported)) if v and r in spot.ranks}
        verdict = fingerprint.compare([got.get(r, 0) for r in range(len(workers))])
        if verdict is None:
            self.referee_step = None
            return
        names = ", ".join(f"{r} (worker {workers[r]})" for r in verdict.odd)
        what = f"ranks {names} computed micro-batch {spot.index} of step {step + 1} differently"
        if not spot.referee:
            action, why = "referee", "the step is redone with every member computing it"
            self.referee_step = step
        elif verdict.majority:
            action, why = "evict", "the odd member(s) leave and the step is redone"
        else:
            action, why = "stop", "no majority: the job stops"
        if rank == min(r for r in got if r not in verdict.odd or not verdict.majority):
            log.warning("silent corruption (spot check): %s: %s", what, why)
            run_log.event("corruption", step=step + 1, ranks=verdict.odd, workers=[workers[r] for r in verdict.odd],
                          micro_batch=spot.index, check="spot", action=action)
        if action == "evict" and rank in verdict.odd:
            raise ElasticFlowError(f"evicted: its computation differed: {what}", "a replacement joins where "
                                   "launcher.restart_failed=true; check this host's device", protocol.EXIT_MISCOMPUTE)
        if action == "stop":
            raise ElasticFlowError(f"a device computes wrongly: {what}, twice, with no majority to tell which",
                                   "run without one of these workers' hosts (or with 3 or more workers, so a "
                                   "majority decides), and check their devices")
        raise protocol.CommError(f"spot check: {what}")
