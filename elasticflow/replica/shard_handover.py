"""The sharded state across a membership change, for ``Replica``: a retiring member's ranges handed over while
every member is still alive (``hand_over``), and the ranges redistributed over the new generation (``redistribute``).

Both take the membership and the ``shard.ShardedState`` and return what happened; neither knows the trainer.
"""
from __future__ import annotations

import logging
from typing import Any, List, Tuple

from ..distributed import protocol

log = logging.getLogger("elasticflow")


def hand_over(m: Any, shards: Any, generation: int, world: int, samples_seen: int) -> None:
    """At an agreed change that retires members: move the next generation's ranges over the current
    group while every member is alive, so a retiring member's ranges are not lost when it leaves.

    ``m``: the ``Membership`` (in ``generation``, with ``world`` members); ``samples_seen``: the committed progress.
    A failed handover is reported to the agent; the next generation then takes what is held.
    """
    try:
        _, info = m.upcoming(generation)
        new = info.get("members", [])
        pairs = [(old, new.index(w)) for old, w in enumerate(m.members) if w in new]
        if len(pairs) == world or not pairs:
            return  # nobody leaves: the next generation moves what it needs
        plan = shards.redistribute(m.group, samples_seen, (pairs, len(new)))
        moved = sum(p.hi - p.lo for p in plan.moves if p.src != p.dst)
        log.info("handed over %d elements of sharded state before %d member(s) leave", moved, world - len(pairs))
    except protocol.CommError as exc:
        log.warning("handing over sharded state failed (%s); the next generation takes what is held", exc)
        m.report_failure()


def redistribute(m: Any, shards: Any, samples_seen: int, rank: int, generation: int) -> Tuple[List[Any], int]:
    """Deal the ranges over the members of the generation just entered; returns (the ranges no member holds any
    more, how many elements were sent). Parameter servers: each member publishes its role (aggregator or
    trainer), and rank 0 writes who holds what to the job's events (tests read it)."""
    plan = shards.redistribute(m.group, samples_seen)
    moved = sum(p.hi - p.lo for p in plan.moves if p.src != p.dst)
    if shards.serve is not None:
        m.report_role("aggregator" if shards.layout.shard_of(rank) is not None else "trainer")
    if shards.serves() and rank == 0 and m.events is not None:
        from .._util.fileio import append_event
        from .parameter_server import describe

        append_event(m.events, "roles", "worker", generation=generation, moved=moved,
                     **describe(shards.layout, m.members))
    return plan.lost, moved
