"""topology=hierarchical: sum a tensor inside each group of members (a host, by default), across the groups'
leaders, and back: the slow link between groups carries one tensor's allreduce among the leaders, not the
flat ring's 2 x (W - 1) / W of it from every member at each end.

The groups are a function of the generation alone: every member says its group tag (an allgather of its
hash, once per generation), the members of a tag form a group in rank order, and its lowest rank is the
leader. So a leader that dies hands its role to the next member of its group at the next generation, and a
group that empties is simply not there: nothing to elect, nothing to repair.

Each sum is three collectives in turn: a reduce to the leader inside the group, an allreduce among the
leaders, a broadcast from the leader inside the group. Every member ends with the leader's bits, so
members agree exactly; against a flat sum the order of additions differs (float32 rounding). A leader's
relay thread carries each sum across as soon as its group's reduce is in, so a sum started by backward's
first bucket crosses the link while backward computes the next, as a flat allreduce's work would.
"""
from __future__ import annotations

import hashlib
import queue
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

# A sum larger than this is pipelined in pieces of this size (HierarchicalSum). Each piece costs the leaders a
# synchronisation across the slow link, which a piece's pipelining must repay by hiding the group's reduce and
# broadcast of the next and last pieces: on a 100 Mbit/s link, 4 MB pieces of a 41 MB sum were slower than the
# sum whole (with 2 and with 4 workers a host; docs/benchmarks.md, topologies). Buckets (comm.bucket_mb) already
# overlap the sums with backward.
CHUNK_BYTES = 64 << 20


def groups_by_tag(ranks: Sequence[int], tags: Sequence[int]) -> List[List[int]]:
    """``ranks`` grouped by their ``tags[rank]``: rank order inside a group, groups in order of their first rank."""
    out: Dict[int, List[int]] = {}
    for r in ranks:
        out.setdefault(tags[r], []).append(r)
    return list(out.values())


def tag_hash(tag: str) -> int:
    """A group tag as a signed 63-bit integer (what the members allgather to find their groups)."""
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "big") >> 1


class Hierarchy:
    """The groups of one generation and the extra process groups a member takes part in.

    Built by ``comm.Group`` right after its flat process group; ``None`` there when every member is in
    one group or each in its own (then the flat sum is the same traffic, or less). Inside a group, the
    reduces and the broadcasts go on process groups of their own (``up``, ``down``): gloo matches a
    group's collectives by the order they were started, and a leader starts a sum's broadcasts only when
    its allreduce across has come back, by which time the members may have started the next sum's reduce.
    """

    def __init__(self, store, generation: int, rank: int, tags: List[int], opts):
        self.groups = groups_by_tag(range(len(tags)), tags)
        mine = next(g for g in self.groups if rank in g)
        self.local_rank, self.local_size = mine.index(rank), len(mine)
        self.leaders = [g[0] for g in self.groups]
        self.leader = self.local_rank == 0
        self.timeout_s = opts._timeout.total_seconds()

        def group(prefix: str, rank_: int, size: int):
            return dist.ProcessGroupGloo(PrefixStore(f"gen{generation}/{prefix}/", store), rank_, size, opts)

        # Every member builds the groups it belongs to, under prefixes the generation's members agree on.
        self.up = group(f"up{mine[0]}", self.local_rank, self.local_size) if self.local_size > 1 else None
        self.down = group(f"down{mine[0]}", self.local_rank, self.local_size) if self.local_size > 1 else None
        self.across = group("leaders", self.leaders.index(rank), len(self.leaders)) \
            if self.leader and len(self.leaders) > 1 else None
        self._relay: Optional[queue.Queue] = None  # a leader's sums, in the order they started

    def start_sum(self, tensor: torch.Tensor) -> "HierarchicalSum":
        """Start summing ``tensor`` over every member, in place. A leader's relay thread carries each sum
        across as soon as its group's reduce is in, while the caller goes on (backward's next bucket)."""
        s = HierarchicalSum(self, tensor)
        if self.leader:
            if self._relay is None:
                self._relay = queue.Queue()
                threading.Thread(target=_relay, args=(self._relay,), name="elasticflow-hierarchy",
                                 daemon=True).start()
            self._relay.put(s)
        return s

    def close(self) -> None:
        if self._relay is not None:
            self._relay.put(None)  # the thread ends after the sums already queued (each fails fast if broken)
            self._relay = None


def _relay(sums: queue.Queue) -> None:
    while True:
        s = sums.get()
        if s is None:
            return
        s.relay()


def build(pg, store, generation: int, rank: int, world: int, tag: Optional[str], opts) -> Optional[Hierarchy]:
    """The generation's groups by ``tag`` (this member's), or None where a hierarchy would not help.
    ``opts``: the flat group's gloo options (its timeout and device), which the extra groups share."""
    if tag is None or world < 3:
        return None
    mine = torch.tensor([tag_hash(tag)], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    pg.allgather([every], [mine]).wait()
    tags = [int(t.item()) for t in every]
    if len(set(tags)) in (1, world):  # one group, or each its own: the flat sum is no worse
        return None
    return Hierarchy(store, generation, rank, tags, opts)


class HierarchicalSum:
    """A sum over every member, in place: started by ``Hierarchy.start_sum``, finished by ``wait``.

    A sum over ``CHUNK_BYTES`` is pipelined in chunks of that size: while the leaders send chunk k across the
    slow link, the group reduces chunk k + 1 and receives chunk k - 1.
    The reduces (and a member's receives) are started at once; a leader's relay thread does the rest.
    """

    def __init__(self, h: Hierarchy, tensor: torch.Tensor):
        self.h = h
        flat = tensor.view(-1)
        step = max(1, CHUNK_BYTES // max(1, tensor.element_size()))
        self.chunks = [flat[i:i + step] for i in range(0, flat.numel(), step)]
        self.reduces: List[Any] = []
        self.broadcasts: List[Any] = []
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        if h.up is not None:
            opts = dist.ReduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            opts.rootRank = 0
            self.reduces = [h.up.reduce([c], opts) for c in self.chunks]
            if not h.leader:  # the leader's broadcast of each chunk, received as it comes
                self.broadcasts = [h.down.broadcast([c], _root0()) for c in self.chunks]

    def relay(self) -> None:
        """The leader's part, on its relay thread: each chunk across as its reduce is in, then back down."""
        h = self.h
        try:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            across = []
            for k, chunk in enumerate(self.chunks):
                if self.reduces:
                    self.reduces[k].wait()
                if h.across is not None:
                    across.append(h.across.allreduce([chunk], opts))
            for k, chunk in enumerate(self.chunks):
                if across:
                    across[k].wait()
                if h.down is not None:
                    self.broadcasts.append(h.down.broadcast([chunk], _root0()))
            for work in self.broadcasts:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - raised to the caller by wait()
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> None:
        h = self.h
        if not h.leader:
            for work in self.reduces + self.broadcasts:
                work.wait()  # no timeout given: gloo's, the group's, bounds each
            return
        # Each collective of the relay is bounded by the group's timeout; this bound is only a backstop.
        if not self.done.wait(h.timeout_s * (2 * len(self.chunks) + 2)):
            raise RuntimeError(f"the hierarchical sum did not finish in {h.timeout_s:g}s per collective")
        if self.error is not None:
            raise self.error


def _root0():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts
