"""Local SGD and DiLoCo (``topology=local_sgd|diloco``): model replicas that train apart for a round of
``topology.sync_every`` steps, then meet once.

The algorithm is fixed by the config, never by the number of workers:

- K = ``topology.replicas`` model replicas. Replica k trains on the k-th of K contiguous parts of every
  global batch, with an inner optimizer of its own (the run's optimizer and LR schedule) that starts afresh
  at every round.
- At the round's end each replica's move is Δ_k = θ − θ_k (θ: the parameters the round started from), and
  the mean Δ = Σ_k Δ_k / K updates θ. ``local_sgd``: θ ← θ − Δ (the replicas' average). ``diloco``: Δ is the
  outer gradient of a Nesterov step, v ← μ·v + Δ, θ ← θ − outer_lr·(Δ + μ·v) (torch.optim.SGD's formula).
  Buffers (BatchNorm statistics) become the replicas' mean. Every replica starts the next round from θ.
- A round ends at the next multiple of ``sync_every`` steps, or at the run's end; it goes on across an
  epoch's end (the next epoch's order, as a synchronous run's).

Workers host replicas: replica k is trained by worker ``k * W // K`` (W workers). With fewer workers than
replicas a worker trains several, one after the other; with more, the extra workers wait. So "the 1-worker
result" is one process training all K replicas in turn, and any number of workers ends on it (to float32
rounding: only the sum Σ_k Δ_k is added in another order).

Elastic: a round is the unit of commit. Nothing a round computes is kept until its one collective (the
sum of the Δ, the step records and the votes) has succeeded on every member. A member lost in a round
costs the round: the survivors restore θ and train the round again over the new membership, reusing the
Δ of every replica they had finished and still host. Members join at a round's end.

Note: the inner optimizer restarting every round is our choice, not the DiLoCo paper's (which keeps each
worker's AdamW moments across rounds): it keeps a round's starting state common to every worker, so a
lost worker costs one round and never a checkpoint. With plain SGD (no momentum) as the inner optimizer,
which keeps no state, nothing differs.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..backends.common import WEIGHT
from ..data import order as data
from . import grad_check
from ..config import optim
from .._util.context import _context
from ..data.order import GlobalBatch
from ..distributed import protocol
from ..errors import ElasticFlowError
from ..replica.replica import Agreed, agreed

log = logging.getLogger("elasticflow")
KINDS = ("local_sgd", "diloco")
PREFIX = "outer/"  # checkpoint names of the outer state: outer/momentum/<parameter>


def owner(k: int, replicas: int, world: int) -> int:
    """The rank that trains replica ``k`` of ``replicas`` among ``world`` workers.

    >>> [owner(k, 4, 3) for k in range(4)]
    [0, 0, 1, 2]
    """
    return k * world // replicas


def part(batch: GlobalBatch, k: int, replicas: int) -> Tuple[int, int]:
    """Positions [lo, hi) of replica ``k``'s part of ``batch``: K contiguous parts, the first ones one longer."""
    sizes = data.split_evenly(batch.size, replicas)
    lo = batch.start + sum(sizes[:k])
    return lo, lo + sizes[k]


class Outer:
    """The outer optimizer: local SGD's average or DiLoCo's Nesterov step, and its momentum (checkpointed).

    Args:
        kind: local_sgd | diloco; replicas: K; lr, momentum: the outer step's (DiLoCo only).
        layout: the engine's ``flat_layout()``, which names the momentum's stretches in checkpoints.
    """

    def __init__(self, kind: str, replicas: int, sync_every: int, lr: float, momentum: float,
                 layout: List[Tuple[str, Tuple[int, ...]]]):
        self.kind, self.replicas, self.sync_every = kind, replicas, sync_every
        self.lr, self.momentum = lr, momentum
        self.layout = layout
        self.velocity = None  # DiLoCo's v, one flat float32 tensor; None until the first outer step

    def step(self, start, delta_sum):
        """The parameters after the round: ``start`` (θ) and ``delta_sum`` (Σ_k Δ_k), flat float32 tensors."""
        mean = delta_sum / self.replicas
        new = start.clone()
        if self.kind == "local_sgd":
            return new.sub_(mean)
        if self.velocity is None:  # torch.optim.SGD's first step: the buffer is the gradient itself
            self.velocity = mean.clone()
        else:
            self.velocity.mul_(self.momentum).add_(mean)
        update = mean.add(self.velocity, alpha=self.momentum)  # Nesterov
        return new.add_(update, alpha=-self.lr)

    def arrays(self) -> Dict[str, np.ndarray]:
        """The outer state by name, for checkpoints and for a member that joins (copies)."""
        if self.velocity is None:
            return {}
        flat, out, at = self.velocity.numpy(), {}, 0
        for name, shape in self.layout:
            size = int(np.prod(shape))
            out[f"{PREFIX}momentum/{name}"] = flat[at:at + size].reshape(shape).copy()
            at += size
        return out

    def load(self, arrays: Dict[str, np.ndarray]) -> None:
        """Take the outer state from ``arrays`` (a checkpoint's or a member's); none there: no momentum yet
        (a checkpoint of another topology: its momentum starts at the first outer step, as a fresh run's)."""
        import torch

        names = [f"{PREFIX}momentum/{n}" for n, _ in self.layout]
        if self.kind != "diloco" or not all(n in arrays for n in names):
            self.velocity = None
            return
        self.velocity = torch.from_numpy(np.concatenate(
            [np.asarray(arrays[n], np.float32).reshape(-1) for n in names]).astype(np.float32))


class RoundStepper:
    """``stepper.Stepper``'s place for local SGD and DiLoCo: ``attempt(batch)`` trains the whole round that
    starts at ``batch`` and commits all its steps at once (the trainer's loop goes on from the cursor).

    Args: as ``Stepper``'s, with ``outer``: the ``Outer`` built with the parts.
    """

    def __init__(self, parts: Any, t: Any, state: Any, replica: Any, step_log: Any, stop_requested: Any,
                 metric_names: List[str], weight_per_sample: Optional[float] = None):
        del weight_per_sample  # Stepper's float16 weight scale: local SGD refuses precision=16 (config)
        self.p, self.t, self.state, self.replica, self.step_log = parts, t, state, replica, step_log
        self.stop_requested, self.metric_names = stop_requested, metric_names
        self.outer: Outer = parts.outer
        self.order = None
        self.agreed = Agreed()
        self.reduce_started = 0.0
        self._start: Optional[Tuple[int, Any, Dict[str, np.ndarray]]] = None  # (samples_seen, θ, buffers)
        # Replica k's finished part of this round: (Δ_k, buffers, scalars, skips, the generation it trained in).
        self._done: Dict[int, Tuple[Any, Dict[str, np.ndarray], np.ndarray, np.ndarray, int]] = {}
        self._warned_world = 0  # the world size last warned of (more workers than replicas)
        self._began = 0.0  # perf_counter() at this attempt's start

    def round_batches(self, first: GlobalBatch) -> List[GlobalBatch]:
        """The round's global batches from ``first``: to the next multiple of sync_every steps or the run's
        end, whichever comes first; across an epoch's end (the next epoch's order goes on)."""
        sched, step, every = self.p.schedule, self.state.step, self.outer.sync_every
        left = (step // every + 1) * every - step
        if sched.total_steps is not None:
            left = min(left, sched.total_steps - step)
        out, epoch, start = [], first.epoch, first.start
        while len(out) < left:
            if start >= sched.epoch_samples:
                epoch, start = epoch + 1, 0
                if sched.max_epochs is not None and epoch >= sched.max_epochs:
                    break
            out.append(GlobalBatch(epoch, start, min(start + sched.global_batch, sched.epoch_samples)))
            start += sched.global_batch
        return out

    def attempt(self, batch: GlobalBatch) -> Dict[str, Any]:
        """Train the round that starts at ``batch`` once; returns its last step's record."""
        s, replica, outer = self.state, self.replica, self.outer
        self._began = time.perf_counter()
        self.step_log.flush()  # rank 0: the previous round's last record (kept by the trainer's record_step)
        batches = self.round_batches(batch)
        theta, buffers = self._round_start()
        mine = [k for k in range(outer.replicas) if owner(k, outer.replicas, replica.world) == replica.rank]
        if replica.rank == 0 and replica.world > outer.replicas and self._warned_world != replica.world:
            self._warned_world = replica.world
            log.warning("%d workers for topology.replicas=%d: %d of them wait out every round (raise "
                        "topology.replicas to use them)", replica.world, outer.replicas, replica.world - outer.replicas)
        import torch

        delta = torch.zeros_like(theta)
        sums = {n: np.zeros(v.shape, np.float64) for n, v in buffers.items()}
        scalars = np.zeros((len(batches), 1 + len(self.metric_names)))
        skipped = np.zeros(len(batches))
        trained_in = np.zeros(outer.replicas)  # the generation each replica was trained in, + 1 (for the record)
        for k in mine:  # ascending, as one process adds them; across workers gloo's order (float32 rounding)
            if k not in self._done:
                self._done[k] = self._train_replica(k, batches, theta, buffers)
            d, b, sc, sk, trained_in[k] = self._done[k]
            trained_in[k] += 1
            delta += d
            for n in sums:
                sums[n] += b[n]
            scalars += sc
            skipped += sk
        self.reduce_started = time.perf_counter()
        try:
            scalars, skipped, trained_in, agreed = self._sum(delta, sums, scalars, skipped, trained_in)
        except protocol.CommError:
            self._restore(theta, buffers)  # a regroup may save or send this state: it must be θ, not a replica's
            raise
        self._apply(outer.step(theta, delta), {n: v / outer.replicas for n, v in sums.items()})
        if replica.rank == 0:  # which generation trained each replica: tests check each sample was used once
            self.step_log.run_log.event("round", first_step=s.step + 1, last_step=s.step + len(batches),
                                        trained_in=[int(g) - 1 for g in trained_in], generation=replica.generation,
                                        world_size=replica.world)
        return self._commit(batches, scalars, skipped, agreed)

    # ------------------------------------------------------------------ the parts of a round
    def _round_start(self) -> Tuple[Any, Dict[str, np.ndarray]]:
        """θ and the buffers the round starts from, copied once per round (retries restore them)."""
        seen = self.state.cursor.samples_seen
        if self._start is None or self._start[0] != seen:
            engine = self.p.engine
            # Host memory, on a GPU too: θ, the Δ and the outer step are one model's worth once a round.
            self._start = (seen, engine.flat_params().detach().to("cpu", copy=True),
                           {n: np.array(v, copy=True) for n, v in engine.buffer_arrays().items()})
            self._done.clear()  # another round (or a member's newer state): nothing computed applies
        return self._start[1], self._start[2]

    def _restore(self, theta: Any, buffers: Dict[str, np.ndarray]) -> None:
        engine = self.p.engine
        engine.flat_params().copy_(theta)
        engine.params_written()
        if buffers:
            engine.set_buffers(buffers)

    def _train_replica(self, k: int, batches: List[GlobalBatch], theta: Any, buffers: Dict[str, np.ndarray]):
        """Replica ``k``'s inner steps over its parts of ``batches``, from θ with a fresh inner optimizer.
        Returns (Δ_k, its buffers, its part-weighted scalars per step, its skipped steps)."""
        p, t, s = self.p, self.t, self.state
        engine, replicas = p.engine, self.outer.replicas
        _context.replica = k
        orders = {e: self.order if e == batches[0].epoch else p.prefetch.order(e) for e in {b.epoch for b in batches}}
        self._restore(theta, buffers)
        engine.reset_optimizer()
        scalars = np.zeros((len(batches), 1 + len(self.metric_names)))
        skipped = np.zeros(len(batches))
        for j, batch in enumerate(batches):
            lo, hi = part(batch, k, replicas)
            if hi <= lo:  # a last batch smaller than K: this replica has nothing to train on
                continue
            _context.step, _context.epoch = s.step + j + 1, batch.epoch
            engine.train_mode(True)
            engine.zero_grad()
            loss_sum, metric_sums = 0.0, {}
            for i, (a, b) in enumerate(data.micro_batches(lo, hi, t.micro_batch_size)):
                engine.seed(data.micro_seed(p.seed, batch.epoch, lo, i))
                loss_w, metrics_w = engine.accumulate(p.source.rows(orders[batch.epoch][a:b]), (b - a) / (hi - lo))
                loss_sum = loss_sum + loss_w
                for name, v in metrics_w.items():
                    metric_sums[name] = metric_sums.get(name, 0.0) + v
            if (WEIGHT in metric_sums) != (WEIGHT in self.metric_names):
                raise grad_check.weight_unlike_probe(WEIGHT in self.metric_names)
            loss = float(loss_sum)  # a sync point on accelerators; the non-finite check needs it anyway
            # The record's sums: by the replica's share of the samples, or by forward()'s weights (their sums
            # over the replicas then divide by the total in _commit: the global batch's weighted mean).
            weight = 1.0 if WEIGHT in metric_sums else (hi - lo) / batch.size
            scalars[j] = [loss * weight] + [float(metric_sums.get(m, 0.0)) * weight for m in self.metric_names]
            if WEIGHT in metric_sums:  # the replica's inner step: its own weighted mean
                factor = grad_check.per_weight(float(metric_sums[WEIGHT]), s.step + j + 1)
                loss = loss * factor
                engine.scale_grad(factor)
            update = grad_check.decide(grad_check.check(engine, loss, t.grad_clip, None), loss, t.on_nonfinite)
            if update.action == "stop":
                self._restore(theta, buffers)
                raise ElasticFlowError(f"{update.why} at step {s.step + j + 1} in replica {k} (epoch {batch.epoch}); "
                                       "training stopped, no update applied", update.hint, exit_code=1)
            if update.action == "skip":
                log.warning("%s at step %d in replica %d; skipping its update (trainer.on_nonfinite=skip)",
                            update.why, s.step + j + 1, k)
                skipped[j] = 1
                continue
            engine.apply(optim.lr_at(p.spec, s.step + j, p.schedule.total_steps))
        _context.replica = -1
        delta = theta - engine.flat_params().detach().cpu()
        moved = {n: np.asarray(v, np.float64).copy() for n, v in engine.buffer_arrays().items()}
        return delta, moved, scalars, skipped, self.replica.generation

    def _sum(self, delta, sums: Dict[str, np.ndarray], scalars: np.ndarray, skipped: np.ndarray,
             trained_in: np.ndarray):
        """Sum the round over the members: Δ and buffers in one float32 allreduce; the step records, the
        replicas' generations and the votes in a small float64 one. Returns the sums of scalars, skipped and
        trained_in, and what every member agreed."""
        import torch

        replica, m = self.replica, self.replica.membership
        interrupt = bool(self.stop_requested())
        if m is None:
            return scalars, skipped, trained_in, Agreed(interrupt=interrupt, finish=replica.finish_asked)
        generation, votes = replica.generation, replica.votes(interrupt)
        if replica.world == 1:
            return scalars, skipped, trained_in, agreed(votes, generation, 1)
        group = m.group
        flat = torch.cat([delta] + [torch.from_numpy(v.astype(np.float32).reshape(-1)) for v in sums.values()])
        head = [scalars.reshape(-1), skipped, trained_in]
        tail = torch.from_numpy(np.concatenate(head + [votes]))
        group.allreduce_(flat)  # the round's one large transfer: one model's worth, whatever sync_every is
        group.allreduce_(tail)
        delta.copy_(flat[:delta.numel()])
        at = delta.numel()
        for n, v in sums.items():
            v[...] = flat[at:at + v.size].numpy().reshape(v.shape)
            at += v.size
        summed, skipped, trained_in, flags = np.split(tail.numpy(), np.cumsum([s.size for s in head]))
        return summed.reshape(scalars.shape), skipped, trained_in, agreed(flags, generation, replica.world)

    def _apply(self, params, buffers: Dict[str, np.ndarray]) -> None:
        engine = self.p.engine
        engine.flat_params().copy_(params)
        engine.params_written()
        if buffers:
            current = engine.buffer_arrays()
            engine.set_buffers({n: (np.rint(v) if np.issubdtype(current[n].dtype, np.integer) else v)
                                .astype(current[n].dtype) for n, v in buffers.items()})
        engine.reset_optimizer()  # every member holds the same state between rounds

    def _commit(self, batches: List[GlobalBatch], scalars: np.ndarray, skipped: np.ndarray,
                agreed: Agreed) -> Dict[str, Any]:
        """The round's steps, committed at once: the cursor, the counters and a record per step."""
        s, t, replica, p = self.state, self.t, self.replica, self.p
        self.agreed = agreed
        self._start, self._done = None, {}
        now, record = time.time(), {}
        if WEIGHT in self.metric_names:  # weighted sums over the replicas: per unit of the global batch's weight
            w = 1 + self.metric_names.index(WEIGHT)
            totals = scalars[:, w].copy()
            per = [grad_check.per_weight(float(total), s.step + j + 1) for j, total in enumerate(totals)]
            scalars = scalars * np.asarray(per)[:, None]
            scalars[:, w] = totals  # the weight itself is logged as its sum
        for j, batch in enumerate(batches):
            # A round may cross an epoch's end: the trainer's loop goes on in the cursor's epoch.
            s.cursor.epoch, s.cursor.samples_in_epoch = batch.epoch, batch.end
            s.cursor.samples_seen += batch.size
            s.micro_step += sum(len(data.micro_batches(*part(batch, k, self.outer.replicas), t.micro_batch_size))
                                for k in range(self.outer.replicas))
            s.step += 1
            s.skipped_steps += int(skipped[j] > 0)
            record = {"epoch": batch.epoch, "step": s.step, "loss": float(scalars[j, 0]),
                      "lr": optim.lr_at(p.spec, s.step - 1, p.schedule.total_steps),
                      "samples_seen": s.cursor.samples_seen, "world_size": replica.world,
                      "generation": replica.generation, "micro_step": s.micro_step, "global_batch": batch.size,
                      "time": now, **dict(zip(self.metric_names, map(float, scalars[j, 1:])))}
            if skipped[j]:
                record["skipped_replicas"] = int(skipped[j])
            self.step_log.committed(record)
            if j < len(batches) - 1 and replica.rank == 0:  # the last one is the trainer's (record_step)
                # The round's time shared out: its steps are not timed apart (a member trains many replicas).
                self.step_log.write_now({**record, "step_time_s": (time.perf_counter() - self._began) / len(batches)})
        record["round_steps"] = len(batches)  # the trainer's record_step shares the round's time out by it
        s.last_metrics = record
        return record

