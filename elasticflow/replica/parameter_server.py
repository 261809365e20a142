"""topology=parameter_server: aggregators hold the parameters and the optimizer state in shards; trainers
push their gradients to them and pull the new parameters back.

**Roles.** Every worker runs the same program; the roles are dealt again at each generation (``deal``),
from what every member says in one small allreduce: the role it held (shard and copy) and its group tag
(its host). ``topology.aggregators`` shards of the flat parameter vector, each held by ``topology.replica``
aggregator processes: its primary and, with 2, a standby. An aggregator consumes no data; the others
are trainers, and the data of every global batch is dealt over them alone. The deal is sticky: a member
keeps its role while it lives (a standby whose primary died becomes the primary, holding the shard
already), and a role left empty goes to a trainer on the group with the fewest aggregators, so a
primary and its standby sit on different hosts where there are two. With too few members for every
role, the standbys go first, then shards; one worker alone trains and holds everything (the 1-worker
result, ``Layout.single``).

**A step** (``exchange``): the trainers of a host sum their gradients onto the first of them, which sends
each primary its shard of the sum (point to point, the push); a primary sums the hosts' pushes in order
and sends the sum on to its standby; then one small allreduce of every member carries the step's loss,
metrics and votes, as every topology's step does. Each holder updates its shard with the optimizer's
formula (``shard.FlatUpdate``, the same float32 operations as a 1-worker run) and commits; then each
primary sends its shard of the parameters to every member that does not hold it (``pull``): directly on
its own host, and once per other host, where the first member passes it on. So a shard crosses a link
once each way per step and host, whatever the number of trainers there, plus once to a remote standby.

**Faults.** The shards are ``shard.ShardedState``'s held ranges, so a membership change redistributes
them as ZeRO's (``ShardedState.redistribute``): a dead primary's shard is taken from its standby with no
step lost, and a new standby is filled from it. A member that died in the small allreduce can leave some
members committed and others not: an aggregator behind then applies its own sum of the step (it had it
before entering the allreduce: ``shard_plan``'s self-roll), so a trainer's death never loses a shard. A
shard whose primary and standby both died (or ``replica: 1`` and its aggregator died) is lost, and the
trainer falls back to the newest checkpoint (``regroup.fall_back``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..distributed.comm.hierarchy import groups_by_tag
from .shard_plan import Range, owned

# Point-to-point tags (share_state's count from 0, comm's sums from 1 << 24); a pull's carry the shard's index.
PUSH_TAG = 1 << 21          # a host's gradient shard to its primary
FORWARD_TAG = PUSH_TAG + 1  # a primary's sum to its standby
LOCAL_TAG = PUSH_TAG + 2    # a trainer's gradient to its host's first trainer
PULL_TAG = PUSH_TAG + (1 << 16)  # + shard: a primary's parameters to a member
RELAY_TAG = PUSH_TAG + (1 << 17)  # + shard: the same, passed on inside a host


@dataclass(frozen=True)
class Layout:
    """Who holds which shard in one generation: ``holders[s]`` is shard s's primary (a group rank) and
    ``holders[shards + s]`` its standby (with ``copies`` 2). The other members are the trainers."""
    world: int
    holders: Tuple[int, ...]
    shards: int
    copies: int

    @staticmethod
    def single() -> "Layout":
        """One worker: it trains and holds the whole vector."""
        return Layout(1, (0,), 1, 1)

    @property
    def trainers(self) -> List[int]:
        if self.world == 1:
            return [0]
        return [r for r in range(self.world) if r not in self.holders]

    def shard_of(self, rank: int) -> Optional[int]:
        """The shard ``rank`` holds (primary or standby), None for a trainer."""
        return self.holders.index(rank) % self.shards if rank in self.holders else None

    def is_primary(self, rank: int) -> bool:
        return rank in self.holders[:self.shards]

    def needed(self, n: int, rank: int) -> List[Range]:
        s = self.shard_of(rank)
        return [] if s is None else [owned(n, self.shards, s)]

    def role(self, rank: int) -> Tuple[int, int]:
        """(shard, copy) as ``deal`` reads it next generation: copy 0 the primary, 1 the standby; (-1, -1) a trainer."""
        if rank not in self.holders:
            return -1, -1
        i = self.holders.index(rank)
        return i % self.shards, i // self.shards


def deal(roles: Sequence[Tuple[int, int]], tags: Sequence[int], shards: int, copies: int) -> Layout:
    """The roles of a generation of ``len(roles)`` members (the same answer on every member).

    ``roles[r]``: member r's (shard, copy) in the previous generation ((-1, -1): a trainer or a new
    member); ``tags[r]``: its group (host). ``shards``, ``copies``: topology.aggregators, topology.replica.
    """
    world = len(roles)
    if world == 1:
        return Layout.single()
    if shards * copies > world - 1:  # every role but one trainer: the standbys go first, then shards
        copies = 1
        shards = min(shards, world - 1)
    keep = {}  # (shard, copy) -> member
    for r, (s, c) in enumerate(roles):
        if 0 <= s < shards and c in (0, 1):
            keep[(s, c)] = r
    for s in range(shards):  # a standby whose primary died holds the shard already: it becomes the primary
        if (s, 0) not in keep and (s, 1) in keep:
            keep[(s, 0)] = keep.pop((s, 1))
    keep = {k: r for k, r in keep.items() if k[1] < copies}
    taken = set(keep.values())
    on_tag: Dict[int, int] = {}
    for r in taken:
        on_tag[tags[r]] = on_tag.get(tags[r], 0) + 1
    holders = []
    for c in range(copies):
        for s in range(shards):
            if (s, c) not in keep:
                partner = keep.get((s, 1 - c)) if copies == 2 else None
                free = [r for r in range(world) if r not in taken]
                # The fewest aggregators on its group, not its partner's group, not rank 0 (it logs), the highest rank.
                r = min(free, key=lambda m: (on_tag.get(tags[m], 0), partner is not None and tags[m] == tags[partner],
                                             m == 0, -m))
                keep[(s, c)] = r
                taken.add(r)
                on_tag[tags[r]] = on_tag.get(tags[r], 0) + 1
            holders.append(keep[(s, c)])
    return Layout(world, tuple(holders), shards, copies)


def handoff(layout: Optional[Layout], tags: Sequence[int], pairs: Sequence[Tuple[int, int]], n: int, shards: int,
            copies: int) -> Dict[int, List[Range]]:
    """At a scale-down, before members retire: the ranges each staying member (its current rank) must hold so
    that every shard is kept by one of them, from a deal over the staying members alone (the joiners, if any,
    are dealt in next generation). ``pairs``: (current rank, next rank) of each member that stays."""
    staying = [old for old, _ in sorted(pairs, key=lambda p: p[1])]
    sub = deal([layout.role(old) if layout is not None else (-1, -1) for old in staying],
               [tags[old] if old < len(tags) else 0 for old in staying], shards, copies)
    return {old: sub.needed(n, i) for i, old in enumerate(staying)}


def exchange(group, layout: Layout, n: int, grad: torch.Tensor, buffer,
             tags: Sequence[int]) -> Dict[Range, torch.Tensor]:
    """A step's push and forward (the module's note): returns this member's sums by range (a holder's
    shard; nothing on a trainer). The trainers of a host first sum their gradients onto the first of them,
    which pushes once for the host (BytePS's local reduce): a shard crosses each link once per host, not
    once per trainer. ``buffer(name, size)``: a float32 scratch kept from step to step; ``tags``: every
    member's group tag. Raises CommError when a member fails meanwhile."""
    rank = group.rank
    shard = layout.shard_of(rank)
    primaries = layout.holders[:layout.shards]
    pushers = groups_by_tag(layout.trainers, tags)
    if shard is None:
        mates = next(h for h in pushers if rank in h)
        if rank != mates[0]:  # to the host's first trainer, which pushes for the host
            group.exchange([(grad, mates[0], LOCAL_TAG)], [])
            return {}
        total = grad
        if len(mates) > 1:
            received = [buffer(f"mate{i}", n) for i in range(len(mates) - 1)]
            group.exchange([], [(b, m, LOCAL_TAG) for b, m in zip(received, mates[1:])])
            total = buffer("host", n)
            total.copy_(grad)
            for b in received:  # in rank order: the same sum whoever is alive
                total.add_(b)
        group.exchange([(total[slice(*owned(n, layout.shards, s))], p, PUSH_TAG) for s, p in enumerate(primaries)],
                       [])
        return {}
    lo, hi = owned(n, layout.shards, shard)
    standby = layout.holders[layout.shards + shard] if layout.copies == 2 else None
    if layout.is_primary(rank):
        leaders = [h[0] for h in pushers]
        pushed = [buffer(f"push{i}", hi - lo) for i in range(len(leaders))]
        group.exchange([], [(b, t, PUSH_TAG) for b, t in zip(pushed, leaders)])
        total = buffer("sum", hi - lo)
        total.copy_(pushed[0])
        for b in pushed[1:]:  # in the hosts' order: the same bits on the standby, which takes this sum
            total.add_(b)
        if standby is not None:
            group.exchange([(total, standby, FORWARD_TAG)], [])
        return {(lo, hi): total}
    total = buffer("sum", hi - lo)
    group.exchange([], [(total, primaries[shard], FORWARD_TAG)])
    return {(lo, hi): total}


def pull(group, layout: Layout, n: int, params: torch.Tensor, tags: Sequence[int]) -> None:
    """Each primary's shard of ``params`` to every member that does not hold it, in place: directly on its
    own host; on another host once, to the first such member there, which passes it on to the rest."""
    rank = group.rank
    sends, recvs, relay_sends, relay_recvs = [], [], [], []
    for s, p in enumerate(layout.holders[:layout.shards]):
        lo, hi = owned(n, layout.shards, s)
        holding = {h for i, h in enumerate(layout.holders) if i % layout.shards == s}
        for mates in groups_by_tag([r for r in range(layout.world) if r not in holding], tags):
            first, rest = (mates, []) if tags[mates[0]] == tags[p] else (mates[:1], mates[1:])
            if p == rank:
                sends += [(params[lo:hi], r, PULL_TAG + s) for r in first]
            elif rank in first:
                recvs.append((params[lo:hi], p, PULL_TAG + s))
                relay_sends += [(params[lo:hi], r, RELAY_TAG + s) for r in rest]
            elif rank in rest:
                relay_recvs.append((params[lo:hi], first[0], RELAY_TAG + s))
    group.exchange(sends, recvs)
    group.exchange(relay_sends, relay_recvs)


def describe(layout: Layout, members: Sequence[int]) -> Dict[str, List[int]]:
    """The roles by worker id, for the ``roles`` event: primaries, standbys and trainers."""
    h = layout.holders
    return {"primaries": [members[r] for r in h[:layout.shards]],
            "standbys": [members[r] for r in h[layout.shards:]],
            "trainers": [members[r] for r in layout.trainers]}
