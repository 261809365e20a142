"""``trainer.shard=parameters``' frozen parameters (``requires_grad=False``: a LoRA base, a frozen encoder): held in
ranges like the trainable ones, brought in per unit, with no gradient and no optimizer state.

The float32 frozen parameters are one flat vector of their own (the engine's ``frozen_pages``, a ``PagedVector``),
split by the trainable vector's rule: rank r holds ``owned(n, W, r)`` and, with ``elastic.shard_replicas=1``, its
buddy's slice. A unit's forward and backward bring its frozen spans in with its trainable ones (``fetch``) and give
them back after (``param_units.py``).

What makes them simpler than the trainable state: they never change. Every holder of a range holds the same
values at every step, so a membership change needs no progress, no roll forward and no buddy refresh: each member
publishes the ranges it holds, and the ranges the new layout gives a member that it lacks come from the lowest
rank holding them (``redistribute``). A worker that starts (a joiner, a resumed job) built the whole module in
``model()``, so it holds the whole vector until its first redistribution. A range whose holders all died
(an owner and its buddy) is lost like a trainable one: the members fall back to a checkpoint, which holds the frozen
values (each owner writes its own range, ``sharding``).

Frozen parameters of another dtype (an int8 or bfloat16 base) stay whole in every worker.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from ..checkpoint.format import Partial, Sharded
from .held_params import HeldParameters
from .param_units import merge
from .shard_pieces import own_piece
from .shard_plan import KEPT, Range, held_row, needed, owned, plan_moves

TAGS = 1 << 29  # the redistribution's message tags, apart from the fetches' (gloo matches by source and tag)


class FrozenShards(HeldParameters):
    """This worker's ranges of the frozen parameters' vector.

    Args:
        engine: the torch Engine built with ``paged_params=True`` that has frozen float32 parameters
            (``frozen_pages``, ``frozen_layout``).
        replicas: ``elastic.shard_replicas``.
    """

    def __init__(self, engine: Any, replicas: int):
        self.engine, self.replicas = engine, int(replicas)
        self.paged = engine.frozen_pages
        self.params = self.paged.tensor
        self.n = self.paged.n
        offsets = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for _, s in engine.frozen_layout()]).tolist()
        self.param_at = {name: (offsets[i], shape) for i, (name, shape) in enumerate(engine.frozen_layout())}
        self.world, self.rank = 1, 0
        self.held: Dict[Range, Dict] = {(0, self.n): {}}  # HeldParameters reads the ranges (the keys)
        self.group: Any = None
        self._fetches = 0

    # ------------------------------------------------------------------ a membership change
    def redistribute(self, group: Any, want: Dict[int, List[Range]], keep: bool = False) -> List[Range]:
        """Every member of ``group`` receives the ranges ``want`` gives it (by its rank in ``group``) that it does
        not hold, each from the lowest rank holding it. ``keep``: a handoff over the old group: the held ranges stay
        beside the new ones (the next generation may not form). Returns the ranges nobody holds (nothing moved);
        raises CommError when a member fails meanwhile."""
        rows = torch.zeros((group.world, KEPT), dtype=torch.float64)
        rows[group.rank] = torch.tensor(held_row(0, list(self.held)), dtype=torch.float64)
        group.allreduce_(rows)  # progress 0 for every row: the values are the same at every step
        plan = plan_moves(rows.numpy(), want)
        if plan.lost:
            return plan.lost
        sends, recvs = [], []
        for i, move in enumerate(plan.moves):
            piece = self.paged.alias[move.lo:move.hi]  # the alias: not an in-place change autograd would see
            if move.dst == group.rank and move.src != group.rank:
                recvs.append((piece, move.src, TAGS + i))
            elif move.src == group.rank and move.dst != group.rank:
                sends.append((piece, move.dst, TAGS + i))
        group.exchange(sends, recvs)
        mine = want.get(group.rank, [])
        if keep:
            self.held = {r: {} for r in merge(list(self.held) + mine)}
            return []
        self.held = {r: {} for r in mine}
        self.world, self.rank, self.group, self._fetches = group.world, group.rank, group, 0
        self.give_back([(0, self.n)])
        return []

    def want(self, world: int, ranks: Sequence[Tuple[int, int]] = ()) -> Dict[int, List[Range]]:
        """The ranges each member needs in a layout of ``world``: by rank, or by old rank for ``ranks`` ((old,
        new) of the members that stay, a handoff)."""
        pairs = list(ranks) or [(r, r) for r in range(world)]
        return {old: needed(self.n, world, new, self.replicas) for old, new in pairs}

    def hold_all(self) -> None:
        """Every element is here (a checkpoint's whole tensors were loaded into the engine)."""
        self.held = {(0, self.n): {}}

    def keep_local(self, rank: int, world: int) -> None:
        """After every member loaded the same checkpoint: keep this worker's ranges of ``world`` only."""
        self.held = {r: {} for r in needed(self.n, world, rank, self.replicas)}
        self.world, self.rank, self._fetches = world, rank, 0
        self.give_back([(0, self.n)])

    # ------------------------------------------------------------------ checkpoints
    def sharding(self) -> Sharded:
        return Sharded(self.n, {p: at for p, (at, _) in self.param_at.items()})

    def partials(self) -> Dict[str, Partial]:
        """This worker's own range of every frozen parameter, by name."""
        lo, hi = owned(self.n, self.world, self.rank)
        if not any(a <= lo and hi <= b for a, b in self.held):
            lo, hi = 0, 0  # not held (a lost range, before the fallback's load): nothing to write
        return {p: own_piece(self.params, lo, hi, at, shape) for p, (at, shape) in self.param_at.items()}
