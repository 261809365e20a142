"""One attempt at one optimizer step on this worker: accumulate its micro-batches, reduce with the other
members, decide the update (apply, skip, stop), apply it, commit the step and its record.

A failed collective raises ``CommError`` out of ``attempt``, before the commit: the trainer regroups and
calls it again for the same global batch (``ElasticTrainer.train_step``). What the members agreed in the
step's reduction (stop, regroup) is left in ``agreed`` for the trainer to act on at the step boundary.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..backends.common import WEIGHT
from ..data import order as data
from . import fingerprint, grad_check, loss_scale
from .exact_step import ExactStep
from .slowdown import Drills, Slowdown
from .spot_check import SpotCheck
from ..config import optim
from .._util.context import _context
from ..data.order import GlobalBatch
from ..distributed import protocol
from ..errors import ElasticFlowError
from ..replica.replica import Agreed

log = logging.getLogger("elasticflow")
# each member's slots of the step's sums (Stepper._slots): seconds per micro-batch, its fingerprints' halves, then
# its spot check's (spot_check.py)
PRINTS = 2 * fingerprint.Fingerprints.WIDTH
SLOTS = 1 + PRINTS + 2


class Stepper:
    """One step's attempt over the parts the trainer built (``builder.Parts``) and its replica.

    Args:
        parts: the run's parts; t: the trainer config (a plain dataclass); state: the ``TrainState``;
        replica: the ``Replica``; step_log: rank 0's ``StepLog``; stop_requested: whether this worker was
        asked to stop (its vote); metric_names: forward()'s metrics, in the order they are reduced;
        weight_per_sample: forward()'s weight per sample in the start-up probe (``loss_scale.weight_scale``).
    """

    def __init__(self, parts: Any, t: Any, state: Any, replica: Any, step_log: Any, stop_requested: Any,
                 metric_names: List[str], weight_per_sample: Optional[float] = None):
        self.p, self.t, self.state, self.replica, self.step_log = parts, t, state, replica, step_log
        self.stop_requested, self.metric_names = stop_requested, metric_names
        self.order = None           # the epoch's global sample order (set by the trainer at each epoch)
        self.agreed = Agreed()      # what the members agreed on in the last committed step's reduction
        self.reduce_started = 0.0   # perf_counter() when this attempt's reduction began
        self.names = [n for n, _ in parts.engine.flat_layout()]  # the parameters, in the flat order
        self.weighted = WEIGHT in metric_names  # forward() returned a weight in the start-up probe
        # float16: backward on the weighted loss times a power of two that brings it near a share's size
        self.weight_scale = loss_scale.weight_scale(weight_per_sample, t.global_batch_size) if (
            self.weighted and parts.placement.loss_scaling) else 1.0
        self.drills = Drills(replica.membership)  # what `elasticflow inject` asked: one poll a second, after commits
        self.slowdown = Slowdown(replica.membership, self.drills)  # `inject --slow`: sleeps in a step, if asked
        self.balance = parts.balance  # the members' speeds, and the micro-batches dealt by them (balance.py)
        self.balance.run_log = step_log.run_log
        self.flips = fingerprint.Flips(replica.membership, self.drills)  # `inject --bitflip`, if asked
        # The members' parameters, and sharded state's two copies of each range, compared every step (fingerprint.py)
        self.fingerprints = fingerprint.Fingerprints(parts.engine, parts.shards) if (
            parts.fingerprint and replica.membership is not None) else None
        self.spot = SpotCheck(parts.verify_every if t.reproducible else None)  # a micro-batch computed twice

    def attempt(self, batch: GlobalBatch) -> Dict[str, Any]:
        """Train on ``batch`` once; returns the committed step's record.

        The phases, in order: deal this member its share; begin the step (gradient zeroed, loss scale, the
        buffers' and exact sums begun); forward and backward of each micro-batch; start the reduction with the
        other members and, while it is in flight, write rank 0's previous record; read the sums (the buffers
        set, the gradient divided by the weights' total); check, decide and apply the update; move the loss
        scale; commit; all-gather the parameters (sharded state). A ``CommError`` leaves before the commit.
        """
        s, p, replica = self.state, self.p, self.replica
        _context.step, _context.epoch = s.step + 1, batch.epoch
        share, rank, world, costs = self._deal(batch)
        reconciler, exact = self._begin(share)
        spot = self.spot.plan(s.step, (batch.start, batch.end), world, self.t.micro_batch_size, costs) if (
            exact is not None and rank >= 0) else None
        computed = time.perf_counter()
        loss_sum, metric_sums = self._accumulate(batch, share, rank, world, exact, costs, spot)
        self.slowdown.compute(time.perf_counter() - computed, replica.rank)  # as a slow device would, if asked
        slots = self._slots(share, rank, world, computed)
        if spot is not None:  # after the speed's measure: the spot's second computation is not this member's share
            self._verify(batch, spot, rank, world, costs, exact, slots)

        self.reduce_started = time.perf_counter()
        if exact is not None:
            reduction = exact.start(self.stop_requested(), slots)
        else:
            reduction = self._start_reduce(loss_sum, metric_sums, share, reconciler, rank, world, slots)
        self.step_log.flush()  # rank 0: the previous step's record, while the reduction is in flight
        scalars, agreed, buffers = replica.finish_reduce(reduction)
        k, n = 1 + len(self.metric_names), len(self.names)
        prints, spots = scalars[k + n + world:k + n + world + PRINTS * world], scalars[k + n + world + PRINTS * world:]
        scalars, took_part, speeds = scalars[:k], np.asarray(scalars[k:k + n]) > 0, scalars[k + n:k + n + world]
        diverged = self.fingerprints.compare(prints, world) if self.fingerprints else None
        if diverged is not None:  # before anything of the step is applied: it is redone without the odd member
            self.fingerprints.act(diverged, rank, world, s.step, replica, self.step_log)
        if spot is not None:  # likewise: redone with a referee, or without the odd member
            self.spot.check(spot, spots, rank, s.step, replica.data_workers, self.step_log.run_log)
        if buffers is not None:
            p.engine.set_buffers(reconciler.finish(buffers))
        loss, metric_values = scalars[0], dict(zip(self.metric_names, scalars[1:]))
        scaling = p.placement.loss_scaling
        summed = self._gradient_sums(scaling)  # the engine's gradient, or what stands for it in the checks below
        if self.weighted:  # forward() weighted its micro-batches: per unit of the global batch's weight
            loss, metric_values = self._divide_by_weight(loss, metric_values, summed)

        record: Dict[str, Any] = {"epoch": batch.epoch}
        verdict = grad_check.check(p.engine, loss, self.t.grad_clip, s.loss_scale if scaling else None, summed)
        lr = optim.lr_at(p.spec, s.step, p.schedule.total_steps)
        self._update(grad_check.decide(verdict, loss, self.t.on_nonfinite), lr, batch, record, took_part)
        if scaling:
            record["loss_scale"] = s.loss_scale
            s.loss_scale, s.loss_scale_good_steps = loss_scale.next_scale(s.loss_scale, s.loss_scale_good_steps,
                                                                         verdict.overflow)
        self._commit(batch, agreed, record, loss, lr, metric_values, verdict)
        self.step_log.committed(record)
        if p.shards is not None:
            # After the commit: a member failing here leaves the step applied to every range held, and
            # the recovery rebuilds the parameters from them.
            replica.gather()
        self._balance(speeds, rank)
        self.drills.poll()  # after the commit: never between a worker and its step's collective (slowdown.Drills)
        return record

    # ------------------------------------------------------------------ the phases of an attempt, in order
    def _deal(self, batch: GlobalBatch) -> Tuple[data.Share, int, int, Optional[List[float]]]:
        """This member's share of ``batch``, its place among the members that consume data and how many do (parameter
        servers: over the trainers alone; an aggregator, place -1, is dealt no micro-batch), and the costs the
        micro-batches are dealt by (balance.py; None: equal shares)."""
        rank, world = self.replica.data_rank, self.replica.data_world
        costs = self.balance.costs_for(self.replica.generation, world)
        share = data.deal((batch.start, batch.end), rank or 0, world, self.t.micro_batch_size, costs)
        if rank is None:  # an aggregator consumes no data: no micro-batch, and its buffers contribute nothing
            share, rank = data.Share([], share.total, share.total), -1
        return share, rank, world, costs

    def _slots(self, share: data.Share, rank: int, world: int, computed: float) -> np.ndarray:
        """This member's slots of the step's sums, every member's read by all: its seconds per micro-batch since
        ``computed`` (balance.py), then its parameters' fingerprint (fingerprint.py). An `inject --bitflip` asked
        for is made first, so that this step's fingerprint holds it."""
        slots = np.zeros(SLOTS * world)
        if rank < 0:  # an aggregator: no micro-batch, and parameters it does not train
            return slots
        if share.micro:
            slots[rank] = (time.perf_counter() - computed) / len(share.micro)
        flip, fp = self.flips.due(), self.fingerprints
        if flip is not None and fp is not None:
            self.flips.flip(self.p.engine, self.p.shards, flip, self.replica.rank, self.state.step)
        elif flip is not None:
            log.warning("inject --bitflip: not made (elastic.fingerprint=false or a single worker: nothing would "
                        "compare the replicas)")
        if fp is not None:  # in halves: the step's scalars may travel in float32 (exact below 2^24)
            slots[world + PRINTS * rank:world + PRINTS * (rank + 1)] = fp.slots(self.state.step)
        return slots

    def _verify(self, batch: GlobalBatch, spot: Any, rank: int, world: int, costs: Any, exact: ExactStep,
                slots: np.ndarray) -> None:
        """The spot check's second computation where this member is one of its ``ranks`` and not the owner (whose
        ``_accumulate`` observed it), and this member's checksum into its ``slots``."""
        if rank in spot.ranks and rank != spot.owner:
            p, span = self.p, (batch.start, batch.end)
            owner = data.deal(span, spot.owner, world, self.t.micro_batch_size, costs)
            a, b = owner.micro[spot.index - owner.first]
            self.spot.recompute(p.engine, spot, p.source.rows(self.order[a:b]), (b - a) / batch.size,
                                data.micro_seed(p.seed, batch.epoch, batch.start, spot.index), exact.reconciler)
        at = world * (1 + PRINTS) + 2 * rank
        slots[at:at + 2] = self.spot.slots()

    def _begin(self, share: data.Share) -> Tuple[Any, Optional[ExactStep]]:
        """Begin the step: the buffers' reconciler (None where not needed) and trainer.reproducible's exact sums
        (None elsewhere) begun, train mode, the gradient zeroed, the loss scale set, stage 3's sums begun."""
        t, p, engine = self.t, self.p, self.p.engine
        # One worker's buffers are already sequential, but for exact sums: the same arithmetic on any number
        reconciler = p.reconciler if self.replica.world > 1 or t.reproducible else None
        if reconciler is not None:
            reconciler.begin(engine.buffer_arrays(), share.total)  # a worker without micro-batches finishes too
        exact = None
        if t.reproducible:  # the step's exact sums, added micro-batch by micro-batch (exact_step.py)
            exact = ExactStep(self.replica, engine, self.metric_names, len(self.names), reconciler,
                              SLOTS * self.replica.data_world)
        engine.train_mode(True)
        engine.zero_grad()
        if p.placement.loss_scaling:
            engine.grad_scale = self.state.loss_scale * self.weight_scale
        if p.shards is not None and p.shards.units is not None:
            p.shards.units.begin_step()
        return reconciler, exact

    def _accumulate(self, batch: GlobalBatch, share: data.Share, rank: int, world: int, exact: Optional[ExactStep],
                    costs: Optional[List[float]], spot: Any = None) -> Tuple[Any, Dict[str, Any]]:
        """Forward and backward of this member's micro-batches, the gradient accumulated in the engine; returns the
        summed weighted loss and metrics (None, {}: no micro-batch, or trainer.reproducible's exact sums took them).
        ``micro_step`` counts each micro-batch."""
        t, s, p, engine = self.t, self.state, self.p, self.p.engine
        loss_sum, metric_sums = None, {}
        units = None if p.shards is None else p.shards.units
        keys = p.schedule.ahead(batch, share, p.prefetch.depth if rank >= 0 else 0, s.step, rank, world,
                                t.micro_batch_size, costs)
        for i, (a, b) in enumerate(share.micro):
            # Dropout draws from a generator seeded by the micro-batch's place in the global order only.
            engine.seed(data.micro_seed(p.seed, batch.epoch, batch.start, share.first + i))
            rows = p.prefetch.take(keys[i], keys[i + 1:]) if keys else p.source.rows(self.order[a:b])
            if i == len(share.micro) - 1:
                self.replica.begin_backward()  # the gradient is final as backward finishes each bucket
            if units is None:
                loss_w, metrics_w = engine.accumulate(rows, (b - a) / batch.size)
            else:  # trainer.shard=parameters: each unit in for its forward and its backward (param_units.py)
                units.begin()
                with units.saved:
                    loss_w, metrics_w = engine.accumulate(rows, (b - a) / batch.size)
                units.end()
            if (WEIGHT in metrics_w) != self.weighted:
                raise grad_check.weight_unlike_probe(self.weighted)
            if exact is not None:  # trainer.reproducible: into the step's exact sums, micro-batch by micro-batch
                if spot is not None and share.first + i == spot.index:  # its gradient alone: checked (spot_check.py)
                    self.spot.observe(engine.grad_view(), loss_w)
                exact.add(loss_w, metrics_w, share.first + i, share.total)
            elif loss_sum is None:  # the first (often only) micro-batch: no tensor additions
                loss_sum, metric_sums = loss_w, dict(metrics_w)
            else:
                loss_sum = loss_sum + loss_w
                for k, v in metrics_w.items():
                    metric_sums[k] = metric_sums.get(k, 0.0) + v
            s.micro_step += 1
        if units is not None:  # the fetches of the micro-batches a peer was dealt beyond this member's
            units.replay(max(len(data.deal((batch.start, batch.end), r, world, t.micro_batch_size, costs).micro)
                             for r in range(world)) - len(share.micro))
        return loss_sum, metric_sums

    def _start_reduce(self, loss_sum: Any, metric_sums: Dict[str, Any], share: data.Share, reconciler: Any,
                      rank: int, world: int, slots: np.ndarray) -> Any:
        """Start the step's reduction (``Replica.start_reduce``): the loss, the metrics, the parameters' flags, the
        members' slots (``_slots``), this member's vote to stop and its buffers' contribution, with the gradient."""
        engine = self.p.engine
        loss_sum = 0.0 if loss_sum is None else loss_sum  # an empty share (more workers than samples)
        # float(): a sync point on accelerators; the non-finite check needs it anyway.
        scalars = [float(loss_sum)] + [float(metric_sums.get(k, 0.0)) for k in self.metric_names]
        # Summed: > 0 where some member's backward reached the parameter (none from a member without
        # micro-batches).
        scalars += engine.took_part().astype(float).tolist() if share.micro else [0.0] * len(self.names)
        scalars += slots.tolist()
        contribution = None if reconciler is None else reconciler.contribution(
            engine.buffer_arrays(), share.first, len(share.micro), share.total, rank, world)
        return self.replica.start_reduce(scalars, self.stop_requested(), contribution)

    def _gradient_sums(self, scaling: bool) -> Any:
        """What stands for the summed gradient in the checks (norm, overflow, clipping): the owners' ranges with
        sharded sums, the whole gradient exactly or in float64 blocks, or None (the engine's own)."""
        t, p = self.t, self.p
        # The norm's bits must not depend on how stage 3 cuts the gradient among owners: summed exactly under
        # trainer.reproducible (~100 ms per million elements of a range; only there), in float64 blocks under
        # float16's loss scaling (whose casts amplify the last bits of a clipping factor)
        exact = t.reproducible and t.shard == "parameters"
        if p.shards is not None and p.shards.scatters():  # stages 2 and 3, parameter servers: own ranges only
            return grad_check.ScatteredSums(p.shards, self.replica.reduce_sum,
                                            self.replica.allreduce_exact if exact else None, scaling)
        if exact or scaling:  # on one worker (or two, each holding all) as the owners take it
            return grad_check.WholeNorm(p.engine, exact=exact)
        return None

    def _divide_by_weight(self, loss: float, metric_values: Dict[str, float],
                          summed: Any) -> Tuple[float, Dict[str, float]]:
        """forward() weighted its micro-batches: the loss, the metrics and the gradient (in place) per unit of the
        global batch's weight (the ``WEIGHT`` metric, summed over the members)."""
        factor = grad_check.per_weight(metric_values[WEIGHT], self.state.step + 1)
        loss, metric_values = loss * factor, {k: v if k == WEIGHT else v * factor for k, v in metric_values.items()}
        # One pass over the gradient: the weights' total is known only once the step's reduction is done,
        # after backward, so the division cannot ride in the loss.
        if factor / self.weight_scale != 1.0:
            (summed or self.p.engine).scale_grad(factor / self.weight_scale)
        return loss, metric_values

    def _commit(self, batch: GlobalBatch, agreed: Agreed, record: Dict[str, Any], loss: float, lr: float,
                metric_values: Dict[str, float], verdict: Any) -> None:
        """Committed: from here on this worker's state includes the step (its progress, what the members agreed
        for the trainer to act on) and ``record`` is the step's."""
        s, replica = self.state, self.replica
        self.agreed = agreed
        s.cursor.samples_in_epoch = batch.end
        s.cursor.samples_seen += batch.size
        record.update(step=s.step, loss=loss, lr=lr, samples_seen=s.cursor.samples_seen, world_size=replica.world,
                      generation=replica.generation, micro_step=s.micro_step, global_batch=batch.size,
                      time=time.time())
        record.update(metric_values)
        if verdict.grad_norm is not None:
            record["grad_norm"] = verdict.grad_norm
        s.last_metrics = record

    def _balance(self, speeds: List[float], rank: int) -> None:
        """After the commit: the members' agreed speeds into the estimate (balance.py); the member the members
        agreed to evict as a straggler leaves here (``elastic.straggler=evict``), its step committed and logged."""
        evict = self.balance.observe(speeds, self.state.step, self.replica.rank, self.replica.data_workers)
        if evict is not None and evict == rank:
            self.step_log.flush()
            raise ElasticFlowError(f"evicted as a straggler after step {self.state.step} (elastic.straggler=evict)",
                                   "the others go on without it; launcher.restart_failed=true starts a replacement",
                                   exit_code=protocol.EXIT_STRAGGLER)

    def _update(self, update: grad_check.Update, lr: float, batch: GlobalBatch, record: Dict[str, Any],
                took_part: np.ndarray) -> None:
        """Apply the summed gradient (one optimizer step), or skip it, or stop the run: ``update`` says.
        ``took_part``: per parameter, whether some member's backward gave it a gradient in this global batch;
        one that had none sits the step out (torch.optim's skip of a None ``.grad``; ``state.sat_out``)."""
        s = self.state
        if update.action == "stop":
            raise ElasticFlowError(f"{update.why} at step {s.step + 1} (epoch {batch.epoch}); training stopped, "
                                   "no update applied", update.hint, exit_code=1)
        if update.action == "skip":
            s.skipped_steps += 1
            record["skipped"] = True
            if self.p.shards is not None:  # nothing applied: the held ranges are valid at the new progress
                self.p.shards.skipped(s.cursor.samples_seen + batch.size)
            if update.why == "overflow":  # float16: the loss scale comes down (loss_scale.next_scale)
                log.debug("float16 gradient overflow at step %d; loss scale %g -> %g", s.step + 1, s.loss_scale,
                          s.loss_scale * loss_scale.BACKOFF)
                record["overflow"] = True
            else:
                log.warning("%s at step %d; skipping the update (trainer.on_nonfinite=skip)", update.why, s.step + 1)
            return
        idle = None if took_part.all() else took_part
        sat_out = np.array([s.sat_out.get(n, 0) for n in self.names]) if s.sat_out else None
        if self.p.shards is not None:
            self.replica.update(lr, s.step + 1, s.cursor.samples_seen + batch.size, idle, sat_out)
        else:
            self.p.engine.apply(lr, idle, sat_out)
        if idle is not None:
            for i in np.flatnonzero(~took_part):
                s.sat_out[self.names[i]] = s.sat_out.get(self.names[i], 0) + 1
            record["params_without_grad"] = int((~took_part).sum())  # sat this step out
        s.step += 1
