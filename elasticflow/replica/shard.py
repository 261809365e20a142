"""Sharded state (ZeRO stages 1, 2 and 3) that stays elastic: ``trainer.shard=optimizer|gradients|parameters``.

Design
------
**Slices.** The engine's parameters are one flat float32 vector of n elements, in the order of its flat
gradient. With W members, rank r owns the contiguous range ``owned(n, W, r)`` = [r*c, min((r+1)*c, n))
with c = ceil(n / W): equal chunks, the last one shorter (gloo's reduce_scatter and allgather want equal
pieces; the short tail is padded in a scratch chunk). One rule, here and in the checkpoint plan
(``checkpoint.format.Sharded``). The optimizer's slots (SGD's momentum buffer, Adam's two moments) exist
only for the ranges a worker holds: its own and, with ``elastic.shard_replicas=1``, its buddy's, the slice
of rank (r - 1) mod W (every slice is held twice: by its owner and by the next rank). Optimizer bytes per
worker: 2/W of the replicated optimizer's (1/W with ``shard_replicas=0``), plus nothing else: the
parameters stay whole on every worker (stages 1 and 2; stage 3 keeps them in the ranges too: param_units.py).

**The step.** Stage 1 (``optimizer``): the gradient is reduced exactly as without sharding (one allreduce
of the flat gradient with the step's scalars and votes folded in, ``Replica.start_reduce``), so every
member agrees on the same loss, flags and buffers as before. Each member then updates the parameters and
slots of the ranges it holds (its own and its buddy's: the buddy copy is refreshed by computing the same
update from the same reduced gradient, no bytes moved), commits the step, and the owners' parameter
ranges are all-gathered. Stage 2 (``gradients``): the gradient is reduce-scattered (each member receives
only the sum of its own chunk; the votes go in a small allreduce queued behind it), each owner sends its
reduced chunk to its buddy, then the same update and allgather. The update is an elementwise formula
(``sgd_update`` and ``adam_update`` of ``backends/torch/optim.py``, torch.optim's formulas) applied to a
range instead of the whole vector: each element sees the same float32 operations as in a 1-worker run, so
the result differs from it only by the order the reduction summed the workers' gradients (as without
sharding).

**Where state lives between steps.** ``at``: the committed progress (samples seen) at which the held
ranges are valid, parameters and slots alike. A worker's parameters outside its ranges are valid only
once the allgather of the step finished; inside them they are always valid at ``at``.

**A membership change** (``redistribute``, called by the replica in the new generation): every member
publishes (in one small allreduce) its committed progress and the ranges it holds with their progress.
The target progress T is the largest. Every range the new layout needs (each member's own and buddy
range) is covered by ranges held at T, preferring the member itself (nothing moves), then the lowest
rank: only ranges that change owner travel, point to point, parameters and slots together. A member
that died leaves its slice with its buddy. Members one step behind T (they failed in the sum a member
at T completed) first roll forward: a member at T kept the step's reduced gradient until the step's
allgather completed (``last``), sends them the gradient of their ranges, and they apply the same update
(``shard_plan``'s note). If some range has still no holder at T (an owner and its buddy both died)
nothing moves: the replica reports ``lost`` and the trainer falls back to the newest checkpoint on every
member (it logs which ranges were lost and how many steps it redoes). After the transfers, the new
owners' parameter ranges are all-gathered, so every member (joiners, members that missed a generation)
holds the whole vector at T; the rest of the state (buffers, progress) comes from a member at T as
without sharding (``Replica.sync_state``).

A worker that retires at a step boundary (a shrink) hands its ranges over before it leaves: at an agreed
change every old member is alive, so the ranges of the next generation's layout are moved over the old
group first (``handoff``), and the new generation finds them already in place.

Before its first generation a worker holds [0, n) at its own progress (fresh slots, or a checkpoint's):
the first redistribution keeps only its ranges. So a resumed job, a fresh one and a joiner go through
the same protocol.

**Parameter servers** (``topology=parameter_server``, ``parameter_server.py``): the same state with another layout.
The ranges are the shards of ``parameter_server.Layout``, held by the aggregators only (a trainer holds none);
the step's sums come by push instead of reduce-scatter and the parameters go back by pull instead of
allgather; the redistribution, the checkpoints and the fallback are this module's.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._util import pages
from ..backends.common import check_trainable
from ..errors import ElasticFlowError
from ..config.optim import SGD, Adam, OptimizerSpec
from . import parameter_server
# The layout and the plans live in shard_plan; imported here for the callers that know this module.
from .shard_plan import (KEPT, MAX_HELD, WIDTH, Plan, Range, RangeMove, Roll, chunk, covers, held_ranges,  # noqa: F401
                         held_row, needed, owned, plan_moves, plan_roll)
from .flat_update import FlatUpdate, KeptStep, participation_of  # noqa: F401 - shard.FlatUpdate: tests patch it
from .frozen_shards import FrozenShards
from .held_params import HeldParameters
from .shard_scatter import ScatteredGradient
from .shard_pieces import CheckpointPieces

log = logging.getLogger("elasticflow")


class ShardedState(HeldParameters, ScatteredGradient, CheckpointPieces):
    """This worker's ranges of the optimizer state and the steps that keep them.

    Args:
        engine: the backend Engine: its ``flat_params()`` (a 1-D float32 torch tensor of the parameters,
            in the flat gradient's order) is what the update writes, then ``params_written()`` (an engine
            that handed out a copy writes it back); ``flat_layout()``/``flat_runs()`` describe that order.
        spec: the optimizer spec (its ``slots()`` are what is sharded).
        stage: ``optimizer`` (stage 1) or ``gradients`` (stage 2).
        replicas: ``elastic.shard_replicas``: 1 keeps a buddy copy of every slice, 0 none.
        serve: topology=parameter_server's (aggregators, replica, this worker's group tag hash): the
            ranges are the aggregators' shards (``parameter_server.deal``); None: every member holds its own.
    """

    def __init__(self, engine: Any, spec: OptimizerSpec, stage: str, replicas: int,
                 serve: Optional[Tuple[int, int, int]] = None):
        what, instead = ("topology=parameter_server", "topology=ring") if serve else (f"trainer.shard={stage}",
                                                                                     "trainer.shard=none")
        if not isinstance(spec, (SGD, Adam)) or spec.formulas != "torch":
            raise ElasticFlowError(f"{what} has no sharded update for {spec.name or type(spec).__name__} "
                                   "(it shards torch.optim's formulas)", f"use SGD, Adam or AdamW, or pass {instead}")
        self.engine, self.stage, self.replicas = engine, stage, int(replicas)
        engine.release_optimizer()  # its own slots would be whole-model sized
        # Stage 3: the parameters in memory whose pages are given back outside the held ranges (param_units.py)
        self.paged = engine.page_params() if stage == "parameters" else None
        # ... and its frozen float32 parameters in ranges of their own vector (frozen_shards.py)
        self.frozen = FrozenShards(engine, replicas) if self.paged is not None and engine.frozen_pages else None
        self.params = engine.flat_params()
        self.device = self.params.device  # a GPU's: the slots, the scratch and the pieces live there too
        self.group: Any = None             # the group of the last redistribution (stage 3's fetches use it)
        self.units: Any = None             # stage 3: param_units.ParamUnits (the builder installs them)
        self.layout_version = 0            # counts the redistributions: stage 3's units are all out after one
        self.n = int(self.params.numel())
        layout = engine.flat_layout()
        sizes = [int(np.prod(s, dtype=np.int64)) for _, s in layout]
        self.update_fn = FlatUpdate(spec, engine.flat_runs(), sizes,
                                    exact_sqrt=engine.EXACT_SQRT)
        self.slot_names = self.update_fn.slots
        offsets = np.cumsum([0] + sizes).tolist()
        self.param_at = {name: (offsets[i], tuple(shape)) for i, (name, shape) in enumerate(layout)}
        self.world, self.rank = 1, 0       # the layout the held ranges follow
        self.at = 0                        # progress at which the held ranges are valid
        self.held: Dict[Range, Dict[str, torch.Tensor]] = {(0, self.n): self._fresh(0, self.n)}
        self.reduced: Dict[Range, torch.Tensor] = {}   # stage 2: this step's reduced gradient, by range
        self._fetches = 0                              # stage 3: fetches in this generation (their tags)
        self.acc: Optional[torch.Tensor] = None        # stage 3: this step's sums of the own range (reduce_grad)
        self.reproducible = False                      # stage 3: ... summed exactly (the builder sets it)
        self.exact: Any = None                         # ... then in a ReproducibleSum (exact_sum.py), kept from step to step
        self.last: Optional[KeptStep] = None          # the newest step, until its allgather completed
        self._scratch = torch.empty(self._scratch_size(self.n), device=self.device)
        self._buffers: Dict[str, torch.Tensor] = {}   # stage 2's scratch: pieces, reduced chunks (_buffer)
        self.serve = serve
        self.layout: Optional[parameter_server.Layout] = None  # parameter_server: this generation's roles
        self.tags: List[int] = []                     # ... and every member's group tag, by rank

    def serves(self) -> bool:
        """Whether the ranges are aggregators' shards this generation (parameter_server, more than one member)."""
        return self.layout is not None and self.layout.world > 1

    # ------------------------------------------------------------------ what is held
    def _fresh(self, lo: int, hi: int) -> Dict[str, torch.Tensor]:
        # Pages mapped only where written: before its first generation a worker "holds" fresh slots for the
        # whole vector, of which it keeps its slices (the rest is never written, so never in memory). A GPU's
        # are allocated whole (Adam: twice the parameters, until the first generation keeps the slices).
        if self.device.type != "cpu":
            return {s: torch.zeros(hi - lo, device=self.device) for s in self.slot_names}
        return {s: pages.zeros(hi - lo) for s in self.slot_names}

    def slot_bytes(self) -> int:
        """Optimizer-state bytes this worker holds (the per-worker figure on docs/benchmarks.md)."""
        return sum(t.numel() * 4 for slots in self.held.values() for t in slots.values())

    def load(self, engine: Any, arrays: Dict[str, np.ndarray], step: int, at: int) -> None:
        """Load the training state's arrays: a checkpoint's whole tensors (the engine takes the parameters, this
        the slots), or a peer's buffers in a recovery (the parameters came with the ranges and their allgather)."""
        slots = {k: v for k, v in arrays.items() if k.startswith("optimizer/")}
        rest = {k: v for k, v in arrays.items() if k not in slots}
        if all(n in rest for n in self.param_at):
            if self.paged is not None:  # stage 3: every parameter is written (keep_local gives back the rest)
                self.paged.ensure(0, self.n)
            engine.load_state(rest, step)
            self.load_full(slots, at)
            if self.frozen is not None:
                self.frozen.hold_all()
        else:  # the buffers only: frozen parameters are the same on every member (or came with their ranges)
            buffers = engine.buffer_arrays()
            engine.set_buffers({k: v for k, v in rest.items() if k in buffers})

    def load_full(self, slots: Dict[str, np.ndarray], at: int) -> None:
        """Hold [0, n) at progress ``at`` from whole slot tensors by name (a checkpoint's; missing: zeros).
        The parameters were loaded by the engine. The next redistribution keeps only this worker's ranges."""
        check_trainable({**slots, **dict.fromkeys(self.param_at)}, self.param_at, self.slot_names, at)
        self.params = self.engine.flat_params()  # an engine that hands out a copy reads the loaded values
        held = self._fresh(0, self.n)
        for p, (off, shape) in self.param_at.items():
            size = int(np.prod(shape, dtype=np.int64))
            for s in self.slot_names:
                value = slots.get(f"optimizer/{p}/{s}")
                if value is not None:
                    held[s][off:off + size] = torch.from_numpy(np.asarray(value, np.float32).reshape(-1))
        self.held, self.at, self.last = {(0, self.n): held}, int(at), None

    def keep_local(self, rank: int, world: int) -> None:
        """Take this worker's ranges of ``world`` out of what it holds, without moving anything (every
        member loaded the same checkpoint). Parameter servers: the roles of the generation's deal."""
        wanted = self.layout.needed(self.n, rank) if self.layout is not None else needed(self.n, world, rank,
                                                                                         self.replicas)
        self._adopt({r: self._copy_out(r) for r in wanted}, rank, world, self.at)
        if self.frozen is not None:
            self.frozen.keep_local(rank, world)

    def _copy_out(self, r: Range) -> Dict[str, torch.Tensor]:
        lo, hi = r
        for (a, b), slots in self.held.items():
            if a <= lo and hi <= b:
                return {s: v[lo - a:hi - a].clone() for s, v in slots.items()}
        raise KeyError(f"range {r} is not held")

    def _adopt(self, held: Dict[Range, Dict[str, torch.Tensor]], rank: int, world: int, at: int) -> None:
        self.held, self.rank, self.world, self.at = held, rank, world, at
        self.reduced = {}  # a failed attempt's sums: its step is redone
        self._scratch = torch.empty(self._scratch_size(max((b - a for a, b in held), default=0)), device=self.device)
        self.layout_version += 1
        if self.paged is not None:
            self.give_back([(0, self.n)])
        if self.device.type == "cuda":  # the whole-vector slots and the engine's optimizer, now freed, go back to the
            torch.cuda.empty_cache()    # device (torch's cache would keep them from the GPU's other workers)

    def _scratch_size(self, largest: int) -> int:
        """Adam's scratch for the largest range: its denominator, and its L2 term when weight decay is L2."""
        return largest * (2 if self.update_fn.l2 else 1) if self.update_fn.adam else 0

    # ------------------------------------------------------------------ every step
    def update(self, grad: torch.Tensor, lr: float, step: int, at: int, took_part: Optional[np.ndarray] = None,
               sat_out: Optional[np.ndarray] = None) -> None:
        """Update the parameters and slots of every held range from the reduced gradient (stage 1: the
        whole ``grad``; stage 2: the ranges received into ``reduced``). ``step``: the optimizer step this
        is (1-based, Adam's bias correction); ``at``: the progress the step commits; ``took_part``,
        ``sat_out``: which parameters sit the step out, and their own step counts (``optim.stretches``)."""
        scatters = self.scatters()
        plan = self.update_fn.plan(step, took_part, sat_out)
        for (lo, hi), slots in self.held.items():
            g = self.reduced[(lo, hi)] if scatters else grad[lo:hi]
            self.update_fn(lo, self.params[lo:hi], g, slots, lr, plan, self._scratch)
        # Stage 2's reduced ranges are the ones this member holds anyway: no member behind could use them.
        self.last = KeptStep(self.at, at, lr, step, None if scatters else grad, took_part=took_part, sat_out=sat_out)
        self.at = at
        self.reduced = {}
        if not self.gathers():  # else gather() writes them back, once all are in
            self._written()

    def skipped(self, at: int) -> None:
        """A step committed without an update (a non-finite gradient, float16's overflow): the held ranges
        are valid at ``at`` as they are, and a member behind rolls forward by moving nothing."""
        self.last = KeptStep(self.at, at, 0.0, 0, None, applied=False)
        self.at = at

    def keep_step(self) -> bool:
        """Before a recovery zeroes the gradient: copy the kept step's reduced gradient (the engine's until
        now; its allgather failed, so a member may be behind and need it). Costs one copy of the gradient.
        Returns whether the failed attempt had committed its step (it failed in that allgather)."""
        last = self.last
        if last is None or last.kept:
            return False
        if last.grad is not None:
            last.grad = last.grad.clone()
        last.kept = True
        return True

    def _written(self) -> None:
        self.engine.params_written()

    def own_range(self) -> Range:
        """The range this member owns (its buddy holds a copy): ``reduced``'s key for its own sums."""
        return owned(self.n, self.world, self.rank)

    def scatters(self) -> bool:
        """Whether this step's gradient is reduce-scattered (stage 2): not where each member holds the whole
        vector (W = 2 with a buddy copy), since every member then needs every sum and one allreduce gives them."""
        if self.serves():
            return True  # a holder's sums came by push (parameter_server.exchange)
        return self.stage in ("gradients", "parameters") and self.world > 1 and not self.holds_all()

    def gather(self, group: Any) -> None:
        """All-gather the owners' parameter ranges: afterwards every member holds the whole vector.

        Nothing to gather where the ranges held cover the whole vector (W = 2 with a buddy copy: each
        member updated all of it); the same on every member, as it depends on the layout only.
        """
        if self.serves():
            parameter_server.pull(group, self.layout, self.n, self.params, self.tags)
            self._written()
        elif self.gathers():
            group.allgather_flat(self.params, chunk(self.n, self.world))
            self._written()
        # Every member entered this allgather, so every member applied the step: nobody can be behind.
        self.last = None

    def gathers(self) -> bool:
        """Whether a step ends with the parameters' allgather (``gather``)."""
        if self.paged is not None:
            return False  # stage 3: each unit comes in when forward needs it (fetch)
        return self.serves() or (self.world > 1 and not self.holds_all())

    def push(self, group: Any, grad: torch.Tensor) -> None:
        """Parameter servers: this step's push and forward (``parameter_server.exchange``); a holder's sums land in
        ``reduced``, which a holder behind uses to roll forward by itself (``table_row``'s last column)."""
        # Cleared first: should the exchange fail, a roll forward must not take the last step's sums for this one's.
        self.reduced = {}
        self.reduced = parameter_server.exchange(group, self.layout, self.n, grad, self._buffer, self.tags)

    # ------------------------------------------------------------------ a membership change
    def table_row(self, committed: int) -> List[float]:
        """This member's row of ``redistribute``'s table (``shard_plan``'s layout). The held ranges count at
        ``at`` when it is the committed progress or past it (a retried recovery: they were taken at the
        target of a redistribution before the trainer's progress followed); a member never applies a step
        it does not commit (no collective lies between the update and the commit)."""
        held = sorted(self.held)[:MAX_HELD]
        at = self.at if self.at >= committed else -1
        row = held_row(at, held)
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
        if self.frozen is not None and not plan.lost:  # the frozen ranges first: nothing of them rolls forward
            frozen_want = self.frozen.want(target_members[1] if target_members else group.world,
                                           target_members[0] if target_members else ())
            # A frozen range with no holder: the same fall back (the checkpoint holds its values)
            plan.lost = self.frozen.redistribute(group, frozen_want, keep=target_members is not None)
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
                    if self.paged is not None:  # stage 3: the range's memory may have been given back
                        self.paged.ensure(p.lo, p.hi)
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
            self.group, self._fetches = group, 0
            if self.serves():
                parameter_server.pull(group, self.layout, self.n, self.params, self.tags)
            elif self.paged is not None:
                pass  # stage 3: _adopt gave back what is not held; units come in as forward needs them
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
        params = len(self.update_fn.sizes)
        if roll.applied and roll.sends and group.rank == roll.giver:
            grad = self.last.grad
            took = self.last.participation(params)  # which parameters the step left alone, and their counts
            group.exchange([(took, m, tag - 1) for m in roll.takers] +
                           [(grad[lo:hi], m, tag + i) for m in roll.takers
                            for i, (lo, hi) in enumerate(held_ranges(table[m]))], [])
        if group.rank not in roll.takers:
            return
        if roll.applied:
            mine = held_ranges(table[group.rank])
            took_part = sat_out = None
            if roll.sends:
                took = torch.empty(2 * params, dtype=torch.float64)
                grads = [torch.empty(hi - lo, dtype=torch.float32, device=self.device) for lo, hi in mine]
                group.exchange([], [(took, roll.giver, tag - 1)] +
                               [(g, roll.giver, tag + i) for i, g in enumerate(grads)])
                took_part, sat_out = participation_of(took)
            else:  # parameter servers: its own sums of the step (table_row's last column said it has them)
                # Note: which parameters took part came in the votes' sum that this member missed; it applies
                # the step to every parameter (exact unless some parameter had no gradient in that step).
                grads = [self.reduced[r] for r in mine]
            plan = self.update_fn.plan(roll.step, took_part, sat_out)
            for (lo, hi), g in zip(mine, grads):
                self.update_fn(lo, self.params[lo:hi], g, self.held[(lo, hi)], roll.lr, plan, self._scratch)
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
