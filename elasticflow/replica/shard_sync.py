"""How a worker's held ranges of sharded state move at a membership change: the table every member
publishes, the redistribution it plans (``shard_plan``), the roll forward of members one step behind, and
for parameter servers the deal of the roles. ``shard.ShardedState`` inherits these; its docstring has the
design ("A membership change").
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import parameter_server
from .shard_plan import (KEPT, MAX_HELD, WIDTH, Plan, Range, Roll, chunk, covers, held_ranges, needed,
                         plan_moves, plan_roll)

log = logging.getLogger("elasticflow")


class Redistribution:
    """The membership-change half of ``shard.ShardedState`` (which sets every attribute read here)."""

    def table_row(self, committed: int) -> List[float]:
        """This member's row of ``redistribute``'s table (``shard_plan``'s layout). The held ranges count at
        ``at`` when it is the committed progress or past it (a retried recovery: they were taken at the
        target of a redistribution before the trainer's progress followed); a member never applies a step
        it does not commit (no collective lies between the update and the commit)."""
        held = sorted(self.held)[:MAX_HELD]
        at = self.at if self.at >= committed else -1
        row = [at, len(held)] + [x for r in held for x in r]
        row += [0] * (KEPT - len(row))
        # Parameter servers: a holder that has this step's sums of all its ranges can apply it by itself.
        sums = float(at >= 0 and self.serves() and bool(held) and all(r in self.reduced for r in held))
        last = self.last
        if last is not None and last.at == at and (last.grad is not None or not last.applied or self.serves()):
            return row + [last.before, float(last.applied), last.lr, last.step, float(last.grad is not None), sums]
        return row + [-1, 0, 0, 0, 0, sums]

    def redistribute(self, group: Any, committed: int,
                     target_members: Optional[Tuple[Sequence[Tuple[int, int]], int]] = None) -> Plan:
        """Move the ranges so that every member of ``group`` holds what its layout needs.

        ``target_members``: for a handoff over the old group, ([(old rank, new rank)] of the members that
        stay; the new world): the layout is the new one, the receivers the staying old members, and
        the held ranges are kept beside the new ones. Returns the plan (its ``lost`` ranges: nothing
        moved, fall back to a checkpoint). Raises CommError when a member fails meanwhile.
        """
        rows = torch.zeros((group.world, WIDTH), dtype=torch.float64)  # float64: the lr, exactly
        rows[group.rank] = torch.tensor(self.table_row(committed), dtype=torch.float64)
        group.allreduce_(rows)
        table = rows.numpy()
        roll = plan_roll(table)
        if roll is not None:
            self._roll_forward(group, table, roll)
            table[roll.takers, 0] = roll.target
        layout, tags = None, []
        if target_members is None:
            if self.serve is not None:
                layout, tags = self._deal(group)
                want = {r: layout.needed(self.n, r) for r in range(group.world)}
            else:
                want = {r: needed(self.n, group.world, r, self.replicas) for r in range(group.world)}
        elif self.serve is not None:  # the staying members' roles: every shard kept by one of them
            want = parameter_server.handoff(self.layout, self.tags, target_members[0], self.n, *self.serve[:2])
        else:
            pairs, new_world = target_members
            want = {old: needed(self.n, new_world, new, self.replicas) for old, new in pairs}
        plan = plan_moves(table, want)
        if plan.lost:
            if layout is not None:  # the fallback (keep_local) takes its ranges from the checkpoint by it
                self.layout, self.tags = layout, tags
            return plan
        mine = want.get(group.rank, [])
        new: Dict[Range, Dict[str, torch.Tensor]] = {r: self._fresh(*r) for r in mine}
        # Each move travels as its parameters and each slot, sent from where they lie and received into
        # their final place: no packing copy on either side (ranges a member sends and receives are disjoint).
        sends, recvs, k = [], [], 1 + len(self.slot_names)
        for i, p in enumerate(plan.moves):
            if p.dst == group.rank:
                into = self._into(new, p.lo, p.hi)
                if p.src == group.rank:
                    for s, src in zip(self.slot_names, self._held_views(p.lo, p.hi)[1:]):
                        into[s].copy_(src)
                else:
                    recvs += [(t, p.src, i * k + j)
                              for j, t in enumerate([self.params[p.lo:p.hi]] + [into[s] for s in self.slot_names])]
            elif p.src == group.rank:
                sends += [(t, p.dst, i * k + j) for j, t in enumerate(self._held_views(p.lo, p.hi))]
        group.exchange(sends, recvs)
        if target_members is None:
            self._adopt(new, group.rank, group.world, plan.target)
            if layout is not None:  # only now: the roles a member claims at the next deal are what it holds
                self.layout, self.tags = layout, tags
            # Every member's parameters are right where it holds ranges; where those cover the whole vector
            # for every member (W = 2 with buddies), nothing is left to gather.
            if self.serves():
                parameter_server.pull(group, self.layout, self.n, self.params, self.tags)
            elif not all(covers(r, self.n) for r in want.values()):
                group.allgather_flat(self.params, chunk(self.n, self.world))
            self._written()
        else:  # keep what is held until the next generation: it may not form, and then it is needed
            self.held.update(new)
            self.at = plan.target
        return plan

    def _role(self, rank: int) -> Tuple[int, int]:
        return self.layout.role(rank) if self.layout is not None else (-1, -1)

    def _deal(self, group: Any) -> Tuple["parameter_server.Layout", List[int]]:
        """This generation's parameter-server roles and every member's group tag: each says its previous
        role and its tag (one small allreduce), and each deals the same roles from them (``parameter_server.deal``)."""
        rows = torch.zeros((group.world, 3), dtype=torch.int64)
        rows[group.rank] = torch.tensor([*self._role(self.rank), self.serve[2]], dtype=torch.int64)
        group.allreduce_(rows)
        tags = [int(t) for _, _, t in rows.tolist()]
        return parameter_server.deal([(int(a), int(b)) for a, b, _ in rows.tolist()], tags, *self.serve[:2]), tags

    def _roll_forward(self, group: Any, table: np.ndarray, roll: Roll) -> None:
        """The takers apply the giver's kept step to the ranges they hold (the giver sends its reduced
        gradient of them): afterwards they hold them at ``roll.target``. Raises CommError as redistribute."""
        tag = 1 << 20  # apart from the moves' tags (exchange waits for its messages: none is left behind)
        if roll.applied and roll.sends and group.rank == roll.giver:
            grad = self.last.grad
            group.exchange([(grad[lo:hi], m, tag + i) for m in roll.takers
                            for i, (lo, hi) in enumerate(held_ranges(table[m]))], [])
        if group.rank not in roll.takers:
            return
        if roll.applied:
            mine = held_ranges(table[group.rank])
            if roll.sends:
                grads = [torch.empty(hi - lo, dtype=torch.float32) for lo, hi in mine]
                group.exchange([], [(g, roll.giver, tag + i) for i, g in enumerate(grads)])
            else:  # parameter servers: its own sums of the step (table_row's last column said it has them)
                grads = [self.reduced[r] for r in mine]
            for (lo, hi), g in zip(mine, grads):
                self.update_fn(lo, self.params[lo:hi], g, self.held[(lo, hi)], roll.lr, roll.step, self._scratch)
            self._written()
        log.info("rolled %d range(s) of sharded state forward to progress %d with member %d's step %d",
                 len(self.held), roll.target, roll.giver, roll.step)
        self.at = roll.target

    def _held_views(self, lo: int, hi: int) -> List[torch.Tensor]:
        """Parameters then slots of [lo, hi), from a held range containing it (views)."""
        for (a, b), slots in self.held.items():
            if a <= lo and hi <= b:
                return [self.params[lo:hi]] + [slots[s][lo - a:hi - a] for s in self.slot_names]
        raise KeyError(f"range {(lo, hi)} is not held")

    @staticmethod
    def _into(new: Dict[Range, Dict[str, torch.Tensor]], lo: int, hi: int) -> Dict[str, torch.Tensor]:
        for (a, b), slots in new.items():
            if a <= lo and hi <= b:
                return {s: v[lo - a:hi - a] for s, v in slots.items()}
        raise KeyError(f"range {(lo, hi)} is not wanted")
